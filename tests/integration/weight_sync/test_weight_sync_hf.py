"""Weight sync from a dp2 FSDP trainer into a running built-in ``hf`` server, both modes.

After each push the server's greedy output equals HF transformers' greedy output on the trainer's
exported weights and every version advanced. Then the server is SIGKILLed and the next pushes
must fail within their timeout with an error that names the server.
"""

from __future__ import annotations

import json

import pytest
from fsdp_worker import launch
from hf_server_helpers import _check_pushes
from support_paths import SUPPORT

DEAD_TIMEOUT = 10.0


def test_sync_into_hf_server(tiny_model_dir, tiny_model_dir_b, tmp_path):
    from hf_server_helpers import prompts
    from transformers import AutoTokenizer

    from areal_cli.inference.launch import launch_server
    from areal_cli.utils.network import find_free_port

    ps = prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 3)
    server = launch_server("hf", tiny_model_dir_b, log_dir=str(tmp_path), timeout_s=180)
    try:
        spec = {"model_dir": tiny_model_dir, "out": str(tmp_path), "address": server.address,
                "server_pid": server.proc.pid, "group_port": find_free_port(), "prompts": ps,
                "dead_timeout": DEAD_TIMEOUT}
        launch(spec, 2, timeout=600, script=str(SUPPORT / "sync_worker.py"))
    finally:
        server.stop()
    res = json.loads((tmp_path / "sync.json").read_text())
    _check_pushes(res, tmp_path, ps)
    assert (tmp_path / "weights" / "v1" / "model.safetensors").is_file()

    assert [f["kind"] for f in res["failures"]] == ["distributed", "disk"]
    for f in res["failures"]:
        assert f["error"] is not None, f"{f['kind']} push to a dead server succeeded"
        assert server.address in f["error"], f["error"]
        assert f["seconds"] < DEAD_TIMEOUT + 15, f"{f['kind']} took {f['seconds']:.1f}s"


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}], ids=["archon_t2", "archon_p2"])
def test_archon_sync_into_hf_server(parallel, tiny_model_dir, tiny_model_dir_b, tmp_path):
    """Full tensors gathered over TP, or streamed from the pipeline stage that owns them, reach the
    server in both modes: its greedy output afterwards equals the trained model's."""
    from hf_server_helpers import prompts
    from transformers import AutoTokenizer

    from areal_cli.inference.launch import launch_server
    from areal_cli.utils.network import find_free_port

    ps = prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 3)
    server = launch_server("hf", tiny_model_dir_b, log_dir=str(tmp_path), timeout_s=180)
    try:
        spec = {"model_dir": tiny_model_dir, "out": str(tmp_path), "address": server.address, "kill": False,
                "server_pid": server.proc.pid, "group_port": find_free_port(), "prompts": ps,
                "engine": "archon", "parallel": parallel}
        launch(spec, 2, timeout=600, script=str(SUPPORT / "sync_worker.py"))
    finally:
        server.stop()
    _check_pushes(json.loads((tmp_path / "sync.json").read_text()), tmp_path, ps)


@pytest.mark.megatron  # multi-process megatron layouts: CI's megatron phase
@pytest.mark.parametrize("layout", ["t2p2", "moe_d2e2"])
def test_megatron_sync_into_hf_server(layout, tiny_model_dir, tiny_model_dir_b, tmp_path):
    """megatron t2p2: each tensor TP-gathered inside its stage and sent from the stage that owns it reaches
    the server in both modes; its greedy output afterwards equals the trained model's. moe_d2e2: a tiny
    Qwen3-MoE whose experts are cut over two ranks, streamed in the checkpoint's per-expert names."""
    from hf_server_helpers import prompts
    from transformers import AutoTokenizer

    from areal_cli.engines.megatron import compat
    from areal_cli.inference.launch import launch_server
    from areal_cli.utils.network import find_free_port

    if compat.installed_version() != compat.SUPPORTED_VERSION:
        pytest.skip(f"megatron-core {compat.SUPPORTED_VERSION} is not installed (scripts/install_test_deps.sh)")
    model, served, parallel = tiny_model_dir, tiny_model_dir_b, {"tp": 2, "pp": 2}
    if layout == "moe_d2e2":
        from areal_cli.models.tiny import make_tiny_model

        model = make_tiny_model(tmp_path / "moe", tokenizer_dir=tiny_model_dir, seed=0, family="qwen3_moe")
        served = make_tiny_model(tmp_path / "moe_b", tokenizer_dir=tiny_model_dir, seed=1, family="qwen3_moe")
        parallel = {"dp": 2, "ep": 2}
    ps = prompts(AutoTokenizer.from_pretrained(model), 3)
    server = launch_server("hf", served, log_dir=str(tmp_path), timeout_s=180)
    try:
        spec = {"model_dir": model, "out": str(tmp_path), "address": server.address, "kill": False,
                "server_pid": server.proc.pid, "group_port": find_free_port(), "prompts": ps,
                "engine": "megatron", "parallel": parallel}
        launch(spec, 2 if layout == "moe_d2e2" else 4, timeout=600,
               script=str(SUPPORT / "sync_worker.py"))
    finally:
        server.stop()
    _check_pushes(json.loads((tmp_path / "sync.json").read_text()), tmp_path, ps)
