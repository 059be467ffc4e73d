"""Trainer side of the weight-sync integration test (one process per rank, gloo on CPU).

Trains, pushes weights into a running ``hf`` server (disk, then distributed twice), records the
server's greedy outputs and versions after each push, then kills the server and records how the
next pushes fail. Rank 0 writes ``<out>/sync.json`` and HF exports ``<out>/hf_v<N>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_worker import (  # noqa: E402
    engine_config,
    greedy_probe,
    local_batch,
    loss_fn,
    loss_weight_fn,
    make_batch,
)


def main() -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta, WeightUpdateMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.errors import WeightSyncError
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.utils.dist import init_distributed

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    rank, world = init_distributed("gloo")
    out = Path(spec["out"])
    kw = {}
    if spec.get("lora"):  # LoRA: adapter-only pushes, the server serves the adapter by name
        from areal_cli.config.model import LoRAConfig
        from areal_cli.weight_sync.lora import SERVED_NAME

        kw["lora"] = LoRAConfig(**spec["lora"])
    ecfg = engine_config(spec.get("engine_cfg", {}))
    engine = get_engine_cls(spec.get("engine", "fsdp"))(ecfg, OptimConfig(lr=5e-2), total_steps=10, seed=0, **kw)
    engine.initialize(ParallelStrategy(**spec.get("parallel", {"dp": world})), spec["model_dir"])
    client = RemoteInferenceEngine([spec["address"]], timeout_s=60, retries=1, backoff_s=0.2,
                                   lora_name=SERVED_NAME if kw else None)
    res: dict = {"pushes": [], "failures": []}
    from areal_cli.utils.concurrency import LoopRunner

    runner = LoopRunner()  # the loop that owns the client's HTTP session, shared with the engine

    def server_state():
        return greedy_probe(client, runner, spec["prompts"], 120) if rank == 0 else None

    if kw:  # the adapter at version 0 (B = 0: the base model), as the RL trainer loads it at start-up
        engine.push_adapter(WeightUpdateMeta(type="disk", path=str(out / "weights"), version=0, timeout_s=60),
                            [client], loop=runner.loop)
    res["before"] = server_state()
    for step, (kind, dtype) in enumerate([("disk", "float32"), ("distributed", "float32"),
                                          ("distributed", "float32")]):
        engine.train_batch(local_batch(engine, make_batch(step)), loss_fn, loss_weight_fn)
        meta = WeightUpdateMeta(type=kind, path=str(out / "weights"), master_port=spec["group_port"],
                                dtype=dtype, timeout_s=60, bucket_bytes=64 * 1024)
        engine.update_weights(meta, [client], loop=runner.loop)
        v = engine.get_version()
        engine.save(SaveLoadMeta(path=str(out / f"hf_v{v}"), weight_format="hf"))
        if rank == 0:
            toks, vers, sv = server_state()
            res["pushes"].append({"kind": kind, "version": v, "client_version": client.get_version(),
                                  "server_versions": sv, "tokens": toks, "token_versions": vers,
                                  "seconds": engine.last_sync_seconds})
    if not spec.get("kill", True):
        if rank == 0:
            (out / "sync.json").write_text(json.dumps(res))
        dist.barrier()
        engine.destroy()
        return
    if rank == 0:
        os.kill(spec["server_pid"], signal.SIGKILL)
        time.sleep(0.5)
    dist.barrier()
    for kind in ("distributed", "disk"):
        meta = WeightUpdateMeta(type=kind, path=str(out / "weights"), master_port=spec["group_port"],
                                timeout_s=spec["dead_timeout"])
        t0 = time.monotonic()
        try:
            engine.update_weights(meta, [client], loop=runner.loop)
            res["failures"].append({"kind": kind, "error": None, "seconds": time.monotonic() - t0})
        except WeightSyncError as e:
            res["failures"].append({"kind": kind, "error": str(e), "seconds": time.monotonic() - t0})
    if rank == 0:
        (out / "sync.json").write_text(json.dumps(res))
    dist.barrier()
    engine.destroy()


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
