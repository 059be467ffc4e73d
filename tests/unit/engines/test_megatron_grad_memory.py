"""engines/megatron/grad_memory.py's collective wrapper on two real gloo ranks: a reduce-scatter or all-gather whose
group is one rank and whose output is its whole input (the distributed optimizer's buffers at d1) returns at
once; any other call (two ranks, or another output tensor) runs the collective and gives its result."""

from __future__ import annotations

import torch
from gloo_ranks import run_ranks


def _rank_main(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist

    from areal_cli.engines.megatron.grad_memory import _identity_skipped

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # new_group is collective: every rank makes both
    calls: list[str] = []

    def gather(out, inp, group=None, async_op=False):
        calls.append("gather")
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    def scatter(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append("scatter")
        return dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)

    g, s = _identity_skipped(gather), _identity_skipped(scatter)
    res = {}
    # two ranks: the real all-gather into a buffer whose shard this rank's input is
    buf = torch.zeros(4)
    buf[2 * rank:2 * rank + 2] = torch.tensor([1.0, 2.0]) + 10 * rank
    g(buf, buf[2 * rank:2 * rank + 2], group=dist.group.WORLD)
    res["world_gather"] = buf.tolist()
    grads = torch.arange(4.0) + rank
    s(grads[2 * rank:2 * rank + 2], grads, group=dist.group.WORLD)
    res["world_scatter"] = grads[2 * rank:2 * rank + 2].tolist()
    n_world = len(calls)
    # one rank, output = the whole input: skipped, values untouched
    whole = torch.tensor([3.0, 4.0])
    res["solo_skipped"] = (g(whole, whole, group=solo), s(whole, whole, group=solo), whole.tolist())
    n_solo = len(calls) - n_world
    # one rank, another output tensor: the collective runs (a copy)
    other = torch.zeros(2)
    g(other, whole, group=solo)
    res["solo_copy"] = other.tolist()
    res["calls"] = (n_world, n_solo, len(calls) - n_world - n_solo)
    res["marked"] = getattr(_identity_skipped(g), "_areal_single_rank", False) and _identity_skipped(g) is g
    q.put((rank, res))
    dist.barrier()
    dist.destroy_process_group()


def test_single_rank_buffer_collectives_are_skipped_and_others_run():
    got = run_ranks(_rank_main, 2)
    for rank in (0, 1):
        r = got[rank]
        assert r["world_gather"] == [1.0, 2.0, 11.0, 12.0]
        assert r["world_scatter"] == [4.0 * rank + 1, 4.0 * rank + 3]  # (arange(4) + 0) + (arange(4) + 1), its half
        assert r["solo_skipped"] == (None, None, [3.0, 4.0])
        assert r["solo_copy"] == [3.0, 4.0]
        assert r["calls"] == (2, 0, 1)  # the skipped ones never reach the collective
        assert r["marked"]  # wrapping twice keeps one wrapper
