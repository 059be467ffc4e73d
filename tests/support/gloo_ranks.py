"""Spawn ``world`` gloo ranks running ``target(rank, world, port, queue)`` and collect what each puts on
the queue as ``(rank, result)``; the processes are joined (and killed if stuck) either way."""

from __future__ import annotations

import torch.multiprocessing as mp


def run_ranks(target, world: int = 2, timeout: float = 120) -> dict:
    from areal_cli.utils.network import find_free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
