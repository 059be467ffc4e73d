"""Adapter-only weight sync from an FSDP LoRA trainer into a running ``hf`` server, disk and distributed.

After each push the server, which keeps its base weights and applies the pushed adapter to every request
naming it, produces the same greedy tokens as HF transformers on the trainer's merged HF export of that
version, and every version advanced; only adapter tensors travelled.
"""

from __future__ import annotations

import json

from fsdp_worker import launch  # noqa: E402
from hf_server_helpers import _check_pushes  # noqa: E402
from support_paths import SUPPORT


def test_adapter_only_sync_into_hf_server(tiny_model_dir, tmp_path):
    from hf_server_helpers import prompts
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from areal_cli.inference.launch import launch_server
    from areal_cli.utils.network import find_free_port

    ps = prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 3)
    server = launch_server("hf", tiny_model_dir, log_dir=str(tmp_path), timeout_s=180)
    try:
        spec = {"model_dir": tiny_model_dir, "out": str(tmp_path), "address": server.address,
                "server_pid": server.proc.pid, "group_port": find_free_port(), "prompts": ps, "kill": False,
                "lora": {"rank": 4, "alpha": 16.0}, "parallel": {"dp": 1}}
        # One trainer process: d2 = d1 under LoRA is test_lora_engine's; this is about the servers.
        launch(spec, 1, timeout=600, script=str(SUPPORT / "sync_worker.py"))
    finally:
        server.stop()
    res = json.loads((tmp_path / "sync.json").read_text())
    _check_pushes(res, tmp_path, ps)
    # Only the adapter moved: the disk push wrote a peft adapter dir, no model weights.
    v1 = tmp_path / "weights" / "v1"
    assert (v1 / "adapter_model.safetensors").is_file() and not list(v1.glob("model*.safetensors"))
    with safe_open(str(v1 / "adapter_model.safetensors"), "pt") as f:
        assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())
    for push in res["pushes"]:
        assert 0 < push["seconds"]["adapter_bytes"] < 200_000, push["seconds"]
