"""Pipelined multi-bucket distributed sync into a real hf server: many small buckets (stage k+1 /
broadcast k / apply k-1 overlap), with the ``flattened_bucket`` extension and with SGLang's
one-broadcast-per-tensor protocol, fp32 and bf16 on the wire. Afterwards the server's greedy output
equals HF transformers' greedy output on the pushed weights, and the version advanced."""

from __future__ import annotations

import copy

import httpx
import torch
from hf_server_helpers import hf_greedy, load_model, prompts

from areal_cli.api.io_struct import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.inference.launch import launch_server
from areal_cli.utils.concurrency import LoopRunner
from areal_cli.utils.network import find_free_port
from areal_cli.weight_sync.senders import DistributedSender


def _named(model):
    seen = set()
    for n, t in model.state_dict().items():
        if id(t) not in seen:
            seen.add(id(t))
            yield n, t


def test_pipelined_buckets_both_protocols(tiny_model_dir, tiny_model_dir_b, tmp_path):
    from transformers import AutoTokenizer

    p = prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 1, seed=21)[0]
    a, b = load_model(tiny_model_dir), load_model(tiny_model_dir_b)
    server = launch_server("hf", tiny_model_dir_b, log_dir=str(tmp_path), timeout_s=180, env={"OMP_NUM_THREADS": "1"})
    runner = LoopRunner()
    sender = DistributedSender(runner)
    client = RemoteInferenceEngine([server.address], "hf", timeout_s=120, retries=1)
    per_tensor = RemoteInferenceEngine([server.address], "hf", timeout_s=120, retries=1, flattened_bucket=False)
    port = find_free_port()

    def greedy():
        async def go():
            r = await client.agenerate(ModelRequest(input_ids=p, gconfig=GenerationConfig(greedy=True,
                                                                                          max_new_tokens=12)))
            return r.output_tokens
        return runner.run(go())

    try:
        cases = [(a, "float32", True), (b, "float32", False), (a, "bfloat16", True), (b, "bfloat16", False)]
        for version, (model, dtype, flat) in enumerate(cases, start=1):
            meta = WeightUpdateMeta(type="distributed", version=version, master_port=port, world_size=2,
                                    dtype=dtype, bucket_bytes=16 * 1024, timeout_s=60)
            err = sender.send(meta, [client if flat else per_tensor], _named(model), is_src=True)
            assert err is None, err
            assert sender.last_seconds["buckets"] > 4 and sender.last_seconds["flattened"] == float(flat)
            ref = model
            if dtype == "bfloat16":
                ref = copy.deepcopy(model)
                with torch.no_grad():
                    for t in ref.parameters():
                        t.copy_(t.to(torch.bfloat16))
            assert greedy() == hf_greedy(ref, p, 12), f"case {version}: {dtype} flat={flat}"
            v = httpx.get(f"http://{server.address}/get_weight_version").json()["weight_version"]
            assert v == str(version)
    finally:
        sender.close()
        runner.close()
        server.stop()
