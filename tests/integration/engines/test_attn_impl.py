"""engine.attn_impl on the engines (gloo, CPU): sdpa and eager give the same logprobs and gradients (1e-5, fp32)
on packed, padded and shared-prefix micro-batches, under Ulysses cp2 too, and the built model runs the kernel
asked for; the shared-prefix mask is made once per micro-batch and reaches every layer as that one tensor.

The model is the tiny Qwen2 with its matrices redrawn at std 0.2 (tests/support/gpu_check.py): at the tiny
model's own init the logits are near-uniform, and an attention that crosses sequences would move them little.
Two launches feed the default tests (world 1, world 2); megatron and deepspeed have their own, under their
markers.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fsdp_worker import launch
from gpu_check import varied_model

BIG, SMALL = 10_000, 1  # one micro-batch for the batch / one per sequence (a block-diagonal mask each)
TOL = 1e-5
IMPLS = ("sdpa", "eager")
NAMES = {"sdpa": "areal_ulysses_sdpa", "eager": "areal_ulysses_eager"}
# (layout, batch, engine knobs): the paths of HFModelEngine._forward_mb
LAYOUTS = {
    "varlen": ("plain", {"max_tokens_per_mb": BIG}),
    "mask": ("plain", {"max_tokens_per_mb": SMALL}),
    "padded": ("plain", {"max_tokens_per_mb": BIG, "padding_free": False}),
    "shared": ("groups", {"max_tokens_per_mb": BIG}),
}


def _variant(cls: str, impl: str, layout: str, **extra) -> dict:
    batch, knobs = LAYOUTS[layout]
    return {"name": f"{cls}_{impl}_{layout}", "cls": cls, "batch": batch, "engine": {**knobs, "attn_impl": impl},
            "probe": True, "steps": 0, **extra}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> str:
    return varied_model(tiny_model_dir, tmp_path_factory.mktemp("varied_attn"))


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("attn_runs")
    w1 = [_variant("fsdp", i, lay) for i in IMPLS for lay in LAYOUTS]
    w1 += [_variant("archon", i, "varlen") for i in IMPLS]
    # several micro-batches of shared-prefix groups (max_tokens_per_mb=40), each kernel call's mask recorded
    w1 += [{"name": f"fsdp_{i}_spy", "batch": "groups", "engine": {"max_tokens_per_mb": 40, "attn_impl": i},
            "spy_masks": True, "steps": 0} for i in IMPLS]
    w2 = [{**_variant(cls, "eager", "varlen"), "name": f"{cls}_eager_cp2", "parallel": {"cp": 2}}
          for cls in ("fsdp", "archon")]
    launch({"model_dir": model_dir, "out": str(out), "variants": w1}, 1)
    launch({"model_dir": model_dir, "out": str(out), "variants": w2}, 2)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def _close(a: dict, b: dict, tol: float = TOL) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].shape == b[k].shape, k
        diff = (a[k].float() - b[k].float()).abs().max().item()
        assert diff <= tol, f"{k}: max diff {diff:.3g} > {tol}"


@pytest.mark.parametrize("cls,layout", [("fsdp", lay) for lay in LAYOUTS] + [("archon", "varlen")])
def test_eager_matches_sdpa(runs, cls, layout):
    """Forward logprobs and entropy, and the train path's gradients (loss positions only), sdpa against eager."""
    ref, run = runs[f"{cls}_sdpa_{layout}"], runs[f"{cls}_eager_{layout}"]
    assert ref["attn"] == [NAMES["sdpa"]] and run["attn"] == [NAMES["eager"]]  # each built model runs its kernel
    _close(ref["logprobs"], run["logprobs"])
    _close(ref["grads"], run["grads"])
    assert ref["logprobs"]["logprobs"].abs().sum() > 0


@pytest.mark.parametrize("cls", ["fsdp", "archon"])
def test_eager_under_ulysses_matches_sdpa(runs, cls):
    """The Ulysses wrapper runs the chosen kernel over the gathered sequence: eager at cp2 against sdpa at cp1."""
    run = runs[f"{cls}_eager_cp2"]
    assert run["attn"] == [NAMES["eager"]]
    _close(runs[f"{cls}_sdpa_varlen"]["logprobs"], run["logprobs"])
    _close(runs[f"{cls}_sdpa_varlen"]["grads"], run["grads"])


def test_layouts_agree(runs):
    """The four layouts themselves give one answer (so each comparison above is about the kernel)."""
    for layout in ("mask", "padded"):
        _close(runs["fsdp_sdpa_varlen"]["logprobs"], runs[f"fsdp_sdpa_{layout}"]["logprobs"])


@pytest.mark.parametrize("impl", IMPLS)
def test_shared_prefix_mask_is_built_once_per_micro_batch(runs, impl):
    """Every layer's kernel receives the micro-batch's one mask, on the engine's device; one mask per
    micro-batch (the groups batch cut into several at max_tokens_per_mb=40)."""
    run = runs[f"fsdp_{impl}_spy"]
    calls, n_layers = run["mask_calls"], run["n_layers"]
    assert calls and len(calls) % n_layers == 0
    per_mb = [calls[i:i + n_layers] for i in range(0, len(calls), n_layers)]
    # a micro-batch whose rows share no prefix packs plainly: no mask for sdpa (is_causal), eager's causal one
    masked = [layers for layers in per_mb if layers[0] is not None]
    assert len(masked) >= (2 if impl == "sdpa" else len(per_mb)) and len(per_mb) > 2
    for layers in per_mb:
        assert len(set(layers)) == 1, layers  # the same tensor (id, storage) in every layer, or none in all
    for layers in masked:
        assert layers[0][2] == run["device"]
    assert len({layers[0][:2] for layers in masked}) == len(masked)  # a new one per micro-batch


needs_mcore = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (scripts/install_test_deps.sh installs it)")


@pytest.mark.megatron
@needs_mcore
def test_megatron_sdpa_and_eager(model_dir, tmp_path):
    """megatron's local spec: sdpa is the SDPA core attention, eager mcore's own DotProductAttention; both give
    fsdp's sdpa logprobs, and one train step the same loss and gradient norm."""
    from areal_cli.engines.megatron import compat

    if compat.installed_version() != compat.SUPPORTED_VERSION:
        pytest.skip(f"megatron-core {compat.SUPPORTED_VERSION} is not installed")
    vs = [{"name": f"megatron_{i}", "cls": "megatron", "engine": {"attn_impl": i}, "probe": True, "steps": 1}
          for i in IMPLS]
    vs.append({"name": "fsdp_sdpa", "cls": "fsdp", "engine": {"padding_free": False}, "probe": True, "steps": 1})
    launch({"model_dir": model_dir, "out": str(tmp_path), "variants": vs}, 1, timeout=600)
    r = {v["name"]: torch.load(tmp_path / f"{v['name']}.pt", weights_only=False) for v in vs}
    assert r["megatron_sdpa"]["attn"] == ["SDPAttention"] and r["megatron_eager"]["attn"] == ["DotProductAttention"]
    for name in ("megatron_sdpa", "megatron_eager"):
        _close(r["fsdp_sdpa"]["logprobs"], r[name]["logprobs"])
        s, ref = r[name]["stats"][0], r["fsdp_sdpa"]["stats"][0]
        assert abs(s["loss"] - ref["loss"]) <= TOL and abs(s["grad_norm"] - ref["grad_norm"]) <= TOL * ref["grad_norm"]


@pytest.mark.engines
def test_deepspeed_sdpa_and_eager(model_dir, tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install areal-cli[deepspeed])")
    vs = [{"name": f"deepspeed_{i}", "cls": "deepspeed", "engine": {"attn_impl": i}, "probe": True, "steps": 1}
          for i in IMPLS]
    launch({"model_dir": model_dir, "out": str(tmp_path), "variants": vs}, 1, timeout=600)
    ref, run = (torch.load(tmp_path / f"deepspeed_{i}.pt", weights_only=False) for i in IMPLS)
    assert ref["attn"] == [NAMES["sdpa"]] and run["attn"] == [NAMES["eager"]]
    _close(ref["logprobs"], run["logprobs"])
    assert abs(ref["stats"][0]["loss"] - run["stats"][0]["loss"]) <= TOL
    assert abs(ref["stats"][0]["grad_norm"] - run["stats"][0]["grad_norm"]) <= TOL * ref["stats"][0]["grad_norm"]
