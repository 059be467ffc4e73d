"""The fsdp and archon engines on image batches (the tiny Qwen2.5-VL and the tiny Qwen2-VL, rows of the built-in
count_shapes task mixed with text rows; tests/support/vl_worker.py), against a plain HF forward and the
one-process reference.

For the tiny Qwen2.5-VL three launches feed the module: world 1 (the fsdp d1 reference, which also exports;
one row per micro-batch; padded micro-batches; the tower frozen), world 2 (fsdp d2 and c2, archon t2, d2 and
c2) and world 4 (archon d2t2 and t2c2). The tiny Qwen2-VL (same engine code, its own tower, mrope index and
names) runs the world-1 variants but one row per micro-batch and padded, then fsdp d2 and c2 and archon t2
(``LAYOUTS_OF``). Each trains two
steps on image batches with AdamW (eps=1e-2, as the text layout tests: the updated weights then test the
gradients, not float summation order).
"""

from __future__ import annotations

import pytest
import torch
from engine_reference import TOL, assert_matches_reference, diffs  # noqa: E402
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

import vl_worker as VW  # noqa: E402

# multi-process engine layouts against their references: CI's `engines` phase (pytest -m engines tests/integration)
pytestmark = pytest.mark.engines

WORKER = str(SUPPORT / "vl_worker.py")
HF_TOL = 1e-4  # the engine against transformers' own forward, fp32
STEPS = {"steps": 2, "optim": {"eps": 1e-2}}
LAYOUTS = ["ref_x8", "padded", "d2", "c2", "archon_t2", "archon_d2", "archon_c2", "archon_d2t2", "archon_t2c2"]
# the built-in model -> the layouts it runs (the tiny Qwen2-VL: fsdp d2 and c2 and archon t2 beside the reference)
LAYOUTS_OF = {"tiny_vl": LAYOUTS, "tiny_qwen2_vl": ["d2", "c2", "archon_t2"]}
MODELS = list(LAYOUTS_OF)


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    from areal_cli.data.builtin_model import ensure_builtin_model

    root = tmp_path_factory.mktemp("fileroot")
    return lambda name: ensure_builtin_model(root, name)


@pytest.fixture(scope="module")
def all_runs(vl_dirs, tmp_path_factory):
    """The model's launches, run once per module on first use (``-k`` on one model runs only its own)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _launch(vl_dirs(name), tmp_path_factory.mktemp(f"runs_{name}"), LAYOUTS_OF[name])
        return cache[name]
    return get


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vl_dir(vl_dirs, model) -> str:
    return vl_dirs(model)


@pytest.fixture(scope="module")
def runs(all_runs, model) -> dict:
    return all_runs(model)


def _launch(vl_dir: str, out, layouts: list[str]) -> dict:
    export = str(out / "export")
    w1 = [{"name": "ref", "export": export, "probe": True, **STEPS},
          {"name": "ref_x8", "engine": {"max_tokens_per_mb": 1}, **STEPS},
          {"name": "padded", "engine": {"padding_free": False}, **STEPS},
          {"name": "freeze", "freeze": True, **STEPS},
          {"name": "lora", "lora": 4, "optim": {"lr": 1e-2}, "steps": 2}]
    w2 = [{"name": "d2", "parallel": {"dp": 2}, **STEPS},
          {"name": "c2", "parallel": {"cp": 2}, **STEPS},
          {"name": "archon_t2", "cls": "archon", "parallel": {"tp": 2}, **STEPS},
          {"name": "archon_d2", "cls": "archon", "parallel": {"dp": 2}, **STEPS},
          {"name": "archon_c2", "cls": "archon", "parallel": {"cp": 2}, **STEPS}]
    w4 = [{"name": "archon_d2t2", "cls": "archon", "parallel": {"dp": 2, "tp": 2}, **STEPS},
          {"name": "archon_t2c2", "cls": "archon", "parallel": {"tp": 2, "cp": 2}, **STEPS}]
    keep = {"ref", "freeze", "lora", *layouts}
    for world, variants in ((1, w1), (2, w2), (4, w4)):
        variants = [v for v in variants if v["name"] in keep]
        if variants:
            launch({"model_dir": vl_dir, "out": str(out), "variants": variants}, world, script=WORKER, timeout=900)
    res = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    res["export"] = export
    return res


@pytest.fixture(scope="module")
def initial(vl_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{vl_dir}/model.safetensors")


def _hf(path: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def test_the_batch_mixes_image_and_text_rows(vl_dir):
    b = VW.image_batch(vl_dir, 0)
    kinds = [e is not None for e in b["multi_modal"]]
    assert any(kinds) and not all(kinds)
    grids = [e["image_grid_thw"].tolist() for e in b["multi_modal"] if e is not None]
    assert [[1, 8, 8]] in grids and [[1, 8, 6]] in grids  # a square image and a 48x64 one


@pytest.mark.parametrize("model, name", [(m, n) for m in MODELS for n in ["ref", *LAYOUTS_OF[m]]],
                         indirect=["model"])
def test_engine_logprobs_equal_a_plain_hf_forward(runs, vl_dir, name):
    """Packed (several rows, images and text, in one micro-batch), one row per micro-batch, padded, and the
    parallel layouts: each row's logprobs are the HF model's on that row alone, with its images."""
    want = VW.hf_logprobs(_hf(vl_dir), VW.image_batch(vl_dir, 0))
    got = runs[name]["logprobs"]["logprobs"]
    assert (got - want).abs().max().item() <= HF_TOL


def test_images_reach_the_logprobs(runs, vl_dir):
    """The check above can fail: the same rows with other pictures give other logprobs."""
    b = VW.image_batch(vl_dir, 0)
    b["multi_modal"] = [None if e is None else {**e, "pixel_values": torch.randn_like(e["pixel_values"])}
                        for e in b["multi_modal"]]
    other = VW.hf_logprobs(_hf(vl_dir), b)
    assert (other - runs["ref"]["logprobs"]["logprobs"]).abs().max().item() > 1e-2


@pytest.mark.parametrize("model, name", [(m, n) for m in MODELS for n in LAYOUTS_OF[m]], indirect=["model"])
def test_layout_matches_the_one_process_reference(runs, name):
    """Loss and grad norm per step, the forward before training and the updated weights (tower included)."""
    assert_matches_reference(runs["ref"], runs[name])


def test_training_moves_the_tower_and_the_language_model(runs, initial):
    w = runs["ref"]["weights"]
    tower = max(diffs(VW.tower_weights(w), VW.tower_weights(initial)).values())
    lm = max((w[k] - initial[k]).abs().max().item() for k in w if k.startswith("model."))
    assert tower > 100 * TOL and lm > 100 * TOL, (tower, lm)
    assert runs["ref"]["stats"][0]["n_micro_batches"] == 1
    if "ref_x8" in runs:
        assert runs["ref_x8"]["stats"][0]["n_micro_batches"] > 1


def test_freeze_vision_tower_keeps_the_tower(runs, initial):
    run, ref = runs["freeze"], runs["ref"]
    tower_before, tower_after = VW.tower_weights(run["weights_before"]), VW.tower_weights(run["weights"])
    assert tower_before and all(torch.equal(tower_before[k], tower_after[k]) for k in tower_before)
    n_tower = sum(v.numel() for v in VW.tower_weights(initial).values())
    assert run["n_optimized"] == run["n_trainable"] == ref["n_trainable"] - n_tower
    lm = max((run["weights"][k] - initial[k]).abs().max().item() for k in run["weights"] if k.startswith("model."))
    assert lm > 100 * TOL


def test_lora_trains_an_adapter_on_the_language_model_only(runs):
    """LoRA with images: the adapter (hub names) sits on the language model's projections, it trains, and the
    merged weights of everything else (the tower included) stay."""
    run = runs["lora"]
    names = set(run["adapter"])
    assert names and all(n.startswith("model.layers.") for n in names), sorted(names)[:4]
    assert any(".mlp." in n for n in names) and any(".self_attn." in n for n in names)
    assert max(t.abs().max().item() for n, t in run["adapter"].items() if ".lora_B." in n) > 0  # B starts at 0
    before, after = run["weights_before"], run["weights"]
    tower = [k for k in before if k.startswith("visual.")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)


def test_hf_export_round_trip(runs, vl_dir):
    """The export after training loads with AutoModelForImageTextToText, keeps the hub checkpoint's names
    (visual.*, model.*) and gives the trained engine's logprobs on images."""
    from safetensors import safe_open

    with safe_open(f"{vl_dir}/model.safetensors", "pt") as f:
        names = set(f.keys())
    got = set()
    from pathlib import Path

    for p in Path(runs["export"]).glob("model*.safetensors"):
        with safe_open(str(p), "pt") as f:
            got |= set(f.keys())
    assert got == names and any(n.startswith("visual.") for n in got)
    # the stream the weight-sync senders pull (disk and broadcast) carries the same names, the tower included
    # (and the tied head, as for a text model: the export drops it)
    for run in ("ref", "archon_t2", "archon_d2t2"):
        if run in runs:
            assert set(runs[run]["weights"]) - {"lm_head.weight"} == names
    want = runs["ref"]["probe"]
    lp = VW.hf_logprobs(_hf(runs["export"]), VW.image_batch(vl_dir, 7))
    assert (lp - want).abs().max().item() <= HF_TOL
    base = VW.hf_logprobs(_hf(vl_dir), VW.image_batch(vl_dir, 7))
    assert (base - want).abs().max().item() > 100 * TOL  # the export is the trained model, not the initial one
