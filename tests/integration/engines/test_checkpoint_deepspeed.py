"""DeepSpeed checkpoints: ZeRO-3 at d2 resumes bit-exact from DeepSpeed's own checkpoint after SIGKILL,
and the HF export of a ZeRO-3 run is the trained model, loadable by another ZeRO stage."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is installed by scripts/install_test_deps.sh")

from fsdp_worker import launch  # noqa: E402

# multi-process engine layouts against their references: CI's `engines` phase (pytest -m engines tests/integration)
pytestmark = pytest.mark.engines

OPTIM = {"lr": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "weight_decay": 0.01, "grad_clip": 0.5}


def _ds(name, stage=3, **kw):
    return {"name": name, "cls": "deepspeed", "parallel": {"dp": 2}, "optim": OPTIM, "total_steps": 5,
            "engine": {"max_tokens_per_mb": 40,
                       "deepspeed": {"zero_stage": stage, "param_persistence_threshold": 0}},
            **kw}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Two launches: an uninterrupted 5-step run (exported to HF) and a 2-step run saved then SIGKILLed;
    then the resumed run and two engines built from the export."""
    tmp = tmp_path_factory.mktemp("ds_ckpt")
    out, ckpt, ex = tmp / "out", tmp / "ckpt", tmp / "hf_z3"
    out.mkdir()
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": [
        _ds("full", steps=5, export=str(ex)),
        _ds("first", steps=2, save=str(ckpt), kill_after=True),
    ]}, 2, expect_kill=True)
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": [
        _ds("resumed", start=2, steps=5, load=str(ckpt)),
        _ds("z1_from_z3", stage=1, steps=0, model=str(ex)),  # the export at initialize, into ZeRO-1
        _ds("z3_load_hf", steps=0, load_hf=str(ex)),  # through load(hf) into a fresh engine's partitions
    ]}, 2)
    res = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    res["export"] = ex
    return res


def test_zero3_resume_after_kill9_is_bit_identical(runs):
    full, first, resumed = runs["full"], runs["first"], runs["resumed"]
    # the tied table row-sharded outside ZeRO-3 (engine.tied_head=auto at 40-token micro-batches): its rows
    # and AdamW moments come back from the per-rank file
    assert full["tied_table"] and resumed["tied_table"]
    assert [s["lr"] for s in resumed["stats"]] == [s["lr"] for s in full["stats"][2:]]
    assert [s["loss"] for s in resumed["stats"]] == [s["loss"] for s in full["stats"][2:]]
    for k, w in full["weights"].items():
        assert torch.equal(w, resumed["weights"][k]), f"{k} differs after resume"
    assert any(not torch.equal(w, first["weights"][k]) for k, w in full["weights"].items())


def test_zero3_hf_export_is_the_model_and_loads_into_any_stage(runs):
    from safetensors.torch import load_file

    saved = load_file(str(runs["export"] / "model.safetensors"))
    trained = dict(runs["full"]["weights"])
    trained.pop("lm_head.weight", None)  # tied: HF stores the embedding once
    assert saved.keys() == trained.keys(), set(saved) ^ set(trained)
    for k in saved:
        assert torch.equal(saved[k], trained[k]), k
    for name in ("z1_from_z3", "z3_load_hf"):
        got = dict(runs[name]["weights"])
        got.pop("lm_head.weight", None)
        assert got.keys() == trained.keys(), (name, set(got) ^ set(trained))
        for k, w in got.items():
            assert torch.equal(w, trained[k]), (name, k)
