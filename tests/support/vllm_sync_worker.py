"""Trainer side of tests/integration/inference/test_vllm_sync.py (one process per rank, gloo on CPU).

Trains one step before each push in ``spec["pushes"]`` (``disk`` / ``distributed``) into a running vLLM
server, and records after each: the push's error (a push may be refused), the engine's and the servers'
versions and vLLM's greedy tokens for the prompts. Successful versions are exported (HF, merged under
LoRA) to ``<out>/hf_v<N>``; rank 0 writes ``<out>/sync.json``. With ``spec["lora"]`` the engine trains an
adapter, pushes only the adapter, and version 0 (B = 0) is loaded first, as the RL trainer does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_worker import greedy_probe, local_batch, loss_fn, loss_weight_fn, make_batch  # noqa: E402


def main() -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta, WeightUpdateMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.errors import WeightSyncError
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.utils.concurrency import LoopRunner
    from areal_cli.utils.dist import init_distributed

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    rank, world = init_distributed("gloo")
    out = Path(spec["out"])
    kw = {}
    if spec.get("lora"):
        from areal_cli.config.model import LoRAConfig
        from areal_cli.weight_sync.lora import SERVED_NAME

        kw["lora"] = LoRAConfig(**spec["lora"])
    engine = get_engine_cls(spec["engine"])(EngineConfig(), OptimConfig(lr=5e-2), total_steps=10, seed=0,
                                            **kw)
    engine.initialize(ParallelStrategy(**spec["parallel"]), spec["model_dir"])
    client = RemoteInferenceEngine([spec["address"]], "vllm", timeout_s=120, retries=1, backoff_s=0.2,
                                   lora_name=SERVED_NAME if kw else None)
    runner = LoopRunner()  # the loop that owns the client's HTTP session, shared with the engine

    def server_state():  # vLLM's tokens and the servers' versions
        if rank != 0:
            return None
        tokens, _, versions = greedy_probe(client, runner, spec["prompts"], 300)
        return tokens, versions

    def meta(kind: str, version: int = 0) -> WeightUpdateMeta:
        return WeightUpdateMeta(type=kind, path=str(out / "weights"), master_port=spec["group_port"],
                                dtype="float32", timeout_s=120, bucket_bytes=64 * 1024, version=version)

    res: dict = {"pushes": []}
    if kw:  # the adapter at version 0 (B = 0: the base model), as the RL trainer loads it at start-up
        engine.push_adapter(meta("disk"), [client], loop=runner.loop)
    res["before"] = server_state()
    for step, kind in enumerate(spec["pushes"]):
        engine.train_batch(local_batch(engine, make_batch(step)), loss_fn, loss_weight_fn)
        t0, error = time.monotonic(), None
        try:
            engine.update_weights(meta(kind), [client], loop=runner.loop)
        except WeightSyncError as e:
            error = str(e)
        seconds = time.monotonic() - t0
        v = engine.get_version()
        if error is None:
            engine.save(SaveLoadMeta(path=str(out / f"hf_v{v}"), weight_format="hf"))
        if rank == 0:
            toks, sv = server_state()
            res["pushes"].append({"kind": kind, "error": error, "seconds": seconds, "version": v,
                                  "client_version": client.get_version(), "server_versions": sv,
                                  "tokens": toks})
    if rank == 0:
        (out / "sync.json").write_text(json.dumps(res))
    dist.barrier()
    engine.destroy()


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
