"""The megatron-core 0.16.1 CPU shim: every patch is still needed (the unpatched mcore code path hits CUDA
or fails) and still works (the patched path runs and gives the right value). Two gloo processes, TP1 PP2,
tiny tied Qwen2. Skips when megatron-core 0.16.1 is not installed."""

from __future__ import annotations

import json

import pytest
from fsdp_worker import launch  # noqa: E402
from megatron_worker import TRAIN_PATCHES
from support_paths import SUPPORT

from areal_cli.engines.megatron import compat
from areal_cli.errors import ConfigError  # noqa: E402

needs_mcore = pytest.mark.skipif(compat.installed_version() != compat.SUPPORTED_VERSION,
                                 reason=f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                                        "(scripts/install_test_deps.sh installs it)")

PATCHES = [p.name for p in compat.patches() if p.name not in TRAIN_PATCHES]
# the rank whose code path the patch covers: p2p receive buffers are allocated by the receiving stage
RANKS = {"p2p_buffers": [1]}


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore_compat")
    launch({"mode": "compat", "out": str(out)}, 2, timeout=300,
           script=str(SUPPORT / "megatron_worker.py"))
    return json.loads((out / "result.json").read_text())["ranks"]


@needs_mcore
@pytest.mark.parametrize("name", PATCHES)
def test_patch_is_needed_and_works(probes, name):
    for rank in RANKS.get(name, [0, 1]):
        r = probes[rank][name]
        # needed: unpatched, mcore 0.16.1 reaches CUDA (or its CUDA RNG tracker) on a CPU-only torch
        expected = ("invalid tensor size",) if name == "uneven_gather_scatter" else ("cuda", "nvidia driver")
        assert any(s in r["unpatched"].lower() for s in expected), \
            f"{name} looks like a no-op now on rank {rank}: {r['unpatched']}"
        assert r["patched"] == "no error", f"{name} no longer works on rank {rank}: {r['patched']}"


@pytest.fixture(scope="module")
def train_probes(tmp_path_factory, tiny_model_dir):
    from areal_cli.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("mcore_train_compat")
    moe = make_tiny_model(tmp_path_factory.mktemp("probe_moe"), tokenizer_dir=tiny_model_dir, family="qwen3_moe")
    launch({"mode": "train_compat", "out": str(out), "model_dir": tiny_model_dir, "moe_model_dir": moe}, 2,
           timeout=900, script=str(SUPPORT / "megatron_worker.py"))
    return json.loads((out / "result.json").read_text())["ranks"]


# what the unpatched path raises where it is not a CUDA error
EXPECTED = {"moe_router_gemm": ("te_general_gemm",), "alltoall_split_lists": ("incompatible function arguments",)}


def test_every_patch_has_a_probe():
    assert set(PATCHES) | set(TRAIN_PATCHES) == {p.name for p in compat.patches()}


@needs_mcore
@pytest.mark.parametrize("name", sorted(TRAIN_PATCHES))
def test_training_patch_is_needed_and_works(train_probes, name):
    """Leave one out: a megatron train_batch at t2 (the distributed optimizer, sequence parallelism, clipping;
    or bf16 with the plain optimizer; or the tiny MoE under expert parallelism) with every patch but this one
    fails on CUDA (or, for the missing TransformerEngine global and gloo's split sizes, with the error that
    the patch names); with all of them it runs."""
    for rank in (0, 1):
        r = train_probes[rank][name]
        unpatched = r["unpatched"].lower()
        assert any(s in unpatched for s in EXPECTED.get(name, ("cuda",))), \
            f"{name} looks like a no-op now on rank {rank}: {r['unpatched']}"
        assert r["patched"] == "no error", f"{name} no longer works on rank {rank}: {r['patched']}"


def test_wrong_or_missing_version_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: "0.17.0")
    with pytest.raises(ConfigError, match=r"megatron-core 0\.17\.0 is installed.*supports only 0\.16\.1"):
        compat.apply_cpu_compat()
    monkeypatch.setattr(compat, "installed_version", lambda: None)
    with pytest.raises(ConfigError, match="not installed"):
        compat.check_version()


@needs_mcore
def test_not_applied_when_cuda_is_present(monkeypatch):
    import megatron.core.pipeline_parallel.schedules as sch
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = sch.torch
    assert compat.apply_cpu_compat() == []
    assert sch.torch is before and sch.torch is torch


def test_cpu_torch_proxy_maps_only_cuda():
    import torch

    t = compat._CPUTorch()
    assert t.zeros(2, device="cuda").device.type == "cpu"
    assert t.ones(1, device=torch.device("cuda", 0)).device.type == "cpu"
    assert t.cuda.current_device() == "cpu" and t.cuda.synchronize() is None
    assert t.float32 is torch.float32 and t.matmul is torch.matmul
