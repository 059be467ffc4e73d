"""Each train engine's one-rank forward on CUDA against HF transformers' logprobs on the same device, fp32
(scripts/gpu_check.sh; docs/gpu_check.md). The CPU suite compares the engines with each other under gloo;
this checks that each one's CUDA path (NCCL group, device placement, packing on the GPU) computes the same.

An engine whose package is missing is skipped with the reason: megatron-core runs on CUDA with its own code
paths (engines/megatron/compat.py patches only without CUDA) and its local layer spec (sdpa core attention,
the default engine.attn_impl); TransformerEngine's spec serves engine.attn_impl=flash_attention_2 only.
``test_flash_attention_2_matches_sdpa`` runs flash-attn where it is installed, against sdpa.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fsdp_worker import launch, make_batch, make_group_batch
from gpu_check import DEVICE, REHEARSING, needs_cuda, record, varied_model

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.timeout(600)]

TOL = 1e-4  # fp32 on both sides; kernels and packing differ, so not bit-equal


def _missing(engine: str) -> str | None:
    """Why ``engine`` cannot run here, or None."""
    if engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install areal-cli[deepspeed])"
    if engine == "megatron":
        from areal_cli.engines.megatron import compat

        v = compat.installed_version()
        if v != compat.SUPPORTED_VERSION:
            return (f"megatron-core {compat.SUPPORTED_VERSION} is not installed (found {v}); "
                    f"pip install --no-deps megatron-core=={compat.SUPPORTED_VERSION}")
    return None


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> str:
    return varied_model(tiny_model_dir, tmp_path_factory.mktemp("varied"))


def _hf_logprobs(model_dir: str, **load_kw) -> torch.Tensor:
    """log p(token t | tokens < t) of the workers' batch (0 at position 0 and on padding), as the engines'
    ``forward`` returns it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kw).to(DEVICE).eval()
    b = make_batch(0)
    ids, am = b["input_ids"].to(DEVICE), b["attention_mask"].to(DEVICE)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return (torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * am).cpu()


@pytest.fixture(scope="module")
def hf_logprobs(model_dir) -> torch.Tensor:
    return _hf_logprobs(model_dir)


@pytest.mark.parametrize("engine", ["fsdp", "archon", "megatron", "deepspeed"])
def test_one_rank_forward_matches_hf(engine, model_dir, hf_logprobs, tmp_path):
    why = _missing(engine)
    if why:
        pytest.skip(why)
    variant = {"name": engine, "cls": engine, "fwd": True, "steps": 0}
    backend = "gloo" if REHEARSING else "nccl"
    launch({"model_dir": model_dir, "out": str(tmp_path), "variants": [variant], "backend": backend}, 1,
           timeout=500)
    res = torch.load(tmp_path / f"{engine}.pt", weights_only=False)
    assert res["device"].startswith(DEVICE), f"{engine} ran on {res['device']}, not {DEVICE}"
    got = res["logprobs"]["logprobs"].float()
    am = make_batch(0)["attention_mask"]
    diff = ((got - hf_logprobs) * am).abs().max().item()
    record(f"engine_forward_{engine}", {"max_abs_diff": diff, "engine_device": res["device"]}, tmp_path)
    assert hf_logprobs.abs().sum() > 0
    assert diff <= TOL, f"{engine}: max |engine - HF| logprob {diff:.3g} > {TOL}"


def _varied_moe(src_dir: str, out_dir) -> str:
    """:func:`varied_model` for the MoE model: its fused experts ([E, ., .] in memory) redrawn too, and its norms
    moved off 1, so that a norm loaded into the wrong sublayer changes the logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "norm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    AutoTokenizer.from_pretrained(src_dir).save_pretrained(str(out_dir))
    return str(out_dir)


def test_megatron_te_spec_moe_load_forward_export(moe_model, tmp_path):
    """Qwen3-MoE under TransformerEngine's layer spec, whose MoE layers keep a separate ``pre_mlp_layernorm``
    (a dense layer's is fused into linear_fc1) and whose q/k norms are TENorm: one megatron rank on CUDA loads the
    HF checkpoint, its forward logprobs match HF's (fp32, eager experts), and its HF export is the checkpoint
    bit for bit. The CPU suite checks the names against mcore's spec with TE's classes stood in
    (tests/unit/engines/test_megatron_te_spec.py); this builds TE's real modules."""
    from areal_cli.engines.megatron.model import te_available
    from areal_cli.weight_sync.hf_io import HFCheckpoint

    why = _missing("megatron") or (None if te_available() else
                                   "transformer_engine is not importable: engine=megatron builds the local layer "
                                   "spec, not TE's (pip install transformer-engine[pytorch])")
    if why:
        pytest.skip(why)
    model_dir = _varied_moe(moe_model, tmp_path / "moe")
    ref = _hf_logprobs(model_dir, experts_implementation="eager")
    export = tmp_path / "export"
    variant = {"name": "megatron_te_moe", "cls": "megatron", "fwd": True, "steps": 0, "export": str(export)}
    backend = "gloo" if REHEARSING else "nccl"
    launch({"model_dir": model_dir, "out": str(tmp_path), "variants": [variant], "backend": backend}, 1,
           timeout=500)
    res = torch.load(tmp_path / "megatron_te_moe.pt", weights_only=False)
    assert res["device"].startswith(DEVICE), f"megatron ran on {res['device']}, not {DEVICE}"
    am = make_batch(0)["attention_mask"]
    diff = ((res["logprobs"]["logprobs"].float() - ref) * am).abs().max().item()
    init, back = HFCheckpoint(model_dir), HFCheckpoint(export)
    changed = sorted(n for n in set(init.names()) & set(back.names()) if not torch.equal(init.get(n), back.get(n)))
    record("engine_megatron_te_moe", {"max_abs_diff": diff, "engine_device": res["device"],
                                      "export_not_equal": changed}, tmp_path)
    assert set(back.names()) == set(init.names()), set(back.names()) ^ set(init.names())
    assert not changed, f"HF -> mcore (TE spec) -> HF changed {changed}"
    assert set(res["weights"]) == set(init.names())
    assert ref.abs().sum() > 0
    assert diff <= TOL, f"megatron (TE spec, MoE): max |engine - HF| logprob {diff:.3g} > {TOL}"


FLASH_FLOOR = 0.05  # flash-attn computes in bf16: logprob differences below this are its rounding, never a bug


@pytest.mark.parametrize("engine", ["fsdp", "archon", "deepspeed", "megatron"])
def test_flash_attention_2_matches_sdpa(engine, model_dir, tmp_path):
    """``engine.attn_impl=flash_attention_2`` against sdpa on packed, padded and shared-prefix (flash packs those
    plainly) micro-batches, forward logprobs and one train step. flash-attn has no fp32 kernel, so the bound is
    how far the whole model in bf16 (sdpa, engine.dtype=bfloat16) is from fp32 sdpa, at least FLASH_FLOOR: an
    attention crossing sequences or misplacing tokens moves logprobs by whole units."""
    from areal_cli.engines import attn_impl

    if REHEARSING:
        pytest.skip("flash-attn runs on CUDA only: nothing to rehearse on the CPU")
    if not attn_impl.flash_attn_installed():
        pytest.skip("flash_attn is not installed (pip install flash-attn); engine.attn_impl=flash_attention_2 needs it")
    if engine == "megatron" and not attn_impl.transformer_engine_installed():
        pytest.skip("engine=megatron runs flash_attention_2 only through TransformerEngine, which is not installed")
    why = _missing(engine)
    if why:
        pytest.skip(why)
    # megatron hands TransformerEngine its activations as they are: flash there needs bf16 compute
    flash_dtype = "bfloat16" if engine == "megatron" else "float32"
    layouts = {"packed": ("plain", {}), "padded": ("plain", {"padding_free": False}), "shared": ("groups", {})}
    if engine == "megatron":  # right-padded rows only: no packing, no shared prefix
        layouts = {"padded": ("plain", {})}
    variants = []
    for lay, (batch, knobs) in layouts.items():
        for tag, impl, dtype in (("sdpa", "sdpa", "float32"), ("bf16", "sdpa", "bfloat16"),
                                 ("flash", "flash_attention_2", flash_dtype)):
            variants.append({"name": f"{engine}_{lay}_{tag}", "cls": engine, "batch": batch, "fwd": True, "steps": 1,
                             "engine": {**knobs, "attn_impl": impl, "dtype": dtype}})
    launch({"model_dir": model_dir, "out": str(tmp_path), "variants": variants, "backend": "nccl"}, 1, timeout=500)
    out: dict = {}
    for lay, (batch, _) in layouts.items():
        r = {tag: torch.load(tmp_path / f"{engine}_{lay}_{tag}.pt", weights_only=False) for tag in ("sdpa", "bf16", "flash")}
        b = (make_group_batch if batch == "groups" else make_batch)(0)
        am = b["attention_mask"]
        lp = {tag: r[tag]["logprobs"]["logprobs"].float() * am for tag in r}
        noise = (lp["bf16"] - lp["sdpa"]).abs().max().item()
        diff = (lp["flash"] - lp["sdpa"]).abs().max().item()
        tol = max(FLASH_FLOOR, 2 * noise)
        loss = {tag: r[tag]["stats"][0]["loss"] for tag in r}
        out[lay] = {"max_abs_diff": diff, "bf16_model_diff": noise, "tol": tol, "loss": loss,
                    "grad_norm_flash": r["flash"]["stats"][0]["grad_norm"], "attn": r["flash"]["attn"]}
        assert r["flash"]["device"].startswith("cuda"), r["flash"]["device"]
        assert lp["sdpa"].abs().sum() > 0
        assert diff <= tol, f"{engine} {lay}: max |flash - sdpa| logprob {diff:.3g} > {tol:.3g}"
        assert abs(loss["flash"] - loss["sdpa"]) <= tol, (lay, loss)
        assert torch.isfinite(torch.tensor(r["flash"]["stats"][0]["grad_norm"]))
    record(f"attn_flash_{engine}", out, tmp_path)


@pytest.mark.parametrize("engine", ["fsdp", "archon", "megatron", "megatron_moe", "deepspeed"])
def test_bf16_masters_on_cuda(engine, tiny_model_dir, moe_model, tmp_path):
    """``engine.dtype=bfloat16`` on one CUDA rank (NCCL): the masters are fp32 and equal to the checkpoint, the
    optimizer state fp32 after a step, the LM head's output fp32 and the MLP's matmuls bf16, as the CPU suite
    checks under gloo (tests/integration/engines/test_bf16_engines.py). ``megatron_moe`` is one train step of a
    Qwen3-MoE, whose router statistics are all-reduced after every step (a host tensor on NCCL would fail)."""
    import json
    from pathlib import Path

    cls = engine.replace("_moe", "")
    why = _missing(cls)
    if why:
        pytest.skip(why)
    out = tmp_path / f"{engine}.json"
    worker = str(Path(__file__).resolve().parents[2] / "support" / "precision_worker.py")
    launch({"engine": cls, "model_dir": moe_model if engine.endswith("_moe") else tiny_model_dir,
            "out": str(out), "backend": "gloo" if REHEARSING else "nccl"}, 1, timeout=500, script=worker)
    res = json.loads(out.read_text())
    record(f"bf16_masters_{engine}", res, tmp_path)
    assert res["device"].startswith(DEVICE), f"{engine} ran on {res['device']}, not {DEVICE}"
    assert {m["dtype"] for m in res["masters"].values()} == {"torch.float32"}
    assert max(m["max_diff"] for m in res["masters"].values()) == 0.0
    assert res["optim_state_dtypes"] == ["torch.float32"]
    assert res["head_dtypes"] == ["torch.float32"] and res["linear_dtypes"] == ["torch.bfloat16"]
    assert torch.isfinite(torch.tensor(res["loss"]))
