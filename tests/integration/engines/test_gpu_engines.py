"""Each train engine's one-rank forward on CUDA against HF transformers' logprobs on the same device, fp32
(scripts/gpu_check.sh; docs/gpu_check.md). The CPU suite compares the engines with each other under gloo;
this checks that each one's CUDA path (NCCL group, device placement, packing on the GPU) computes the same.

An engine whose package is missing is skipped with the reason: megatron-core runs on CUDA with its own code
paths (engines/megatron/compat.py patches only without CUDA) and uses TransformerEngine's layer spec when
TE is importable, the local spec otherwise.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fsdp_worker import launch, make_batch
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


@pytest.fixture(scope="module")
def hf_logprobs(model_dir) -> torch.Tensor:
    """log p(token t | tokens < t) of the workers' batch (0 at position 0 and on padding), as the engines'
    ``forward`` returns it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    b = make_batch(0)
    ids, am = b["input_ids"].to(DEVICE), b["attention_mask"].to(DEVICE)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return (torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * am).cpu()


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
