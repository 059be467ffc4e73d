"""utils/collectives.py: the device decision for every backend (CUDA plans included, checked without
CUDA), the default group's backend string, and every helper on a real 1- and 2-process gloo group,
where it must pass tensors straight through (no copy: the CPU reference tests stay bit-identical)."""

from __future__ import annotations

import os

import pytest
import torch
from gloo_ranks import run_ranks

from areal_cli.errors import ConfigError
from areal_cli.utils import collectives as C
from areal_cli.utils.dist import process_group_backend

MIXED = "cpu:gloo,cuda:nccl"


# ------------------------------------------------------------------ pure decisions
@pytest.mark.parametrize("backend, served", [
    ("gloo", ("cpu",)), ("nccl", ("cuda",)), ("NCCL", ("cuda",)), (MIXED, ("cpu", "cuda")),
    ("cuda:nccl", ("cuda",)), ("cpu:gloo", ("cpu",)), ("someplugin", ()),
])
def test_backend_devices(backend, served):
    assert C.backend_devices(backend) == served


@pytest.mark.parametrize("backend, tensor, want", [
    ("gloo", "cpu", "cpu"),  # the CPU test path: straight through
    ("gloo", "cuda", "cpu"),  # gloo on a GPU host: via the host
    ("nccl", "cpu", "cuda"),  # host statistics on a plain NCCL group: staged on the GPU
    ("nccl", "cuda", "cuda"),
    (MIXED, "cpu", "cpu"),  # the default group on GPU hosts serves both as they are
    (MIXED, "cuda", "cuda"),
    ("someplugin", "cpu", "cpu"),  # unknown backend: torch decides
])
def test_comm_device_type(backend, tensor, want):
    assert C.comm_device_type(backend, tensor) == want


def test_comm_device_keeps_the_index_and_needs_no_cuda_when_it_fits():
    assert C.comm_device(MIXED, torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert C.comm_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert C.comm_device("gloo", "cuda:1") == torch.device("cpu")
    assert C.comm_device(MIXED, "cpu") == torch.device("cpu")


@pytest.mark.parametrize("requested, cuda, want", [
    (None, True, MIXED), ("nccl", True, MIXED), ("NCCL", True, MIXED),
    (None, False, "gloo"), ("gloo", True, "gloo"), ("gloo", False, "gloo"), (MIXED, True, MIXED),
])
def test_default_group_backend(requested, cuda, want):
    assert process_group_backend(requested, cuda) == want


def test_nccl_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="needs CUDA"):
        process_group_backend("nccl", False)


# ------------------------------------------------------------------ real gloo groups
def _exercise(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from areal_cli.engines import ulysses
    from areal_cli.engines.archon import expert_parallel
    from areal_cli.utils.dist import broadcast_obj, send_to_rank0

    out: dict = {"backend": C.group_backend(), "same_object": []}
    sub = dist.new_group(list(range(world)))

    t = torch.full((3,), float(rank + 1))
    ptr = t.data_ptr()
    r = C.all_reduce(t)
    out["same_object"].append(r is t and t.data_ptr() == ptr)
    out["all_reduce"] = t.tolist()
    out["all_reduce_max"] = C.all_reduce(torch.tensor([float(rank)]), op=C.ReduceOp.MAX, group=sub).tolist()

    b = torch.full((2,), float(rank))
    out["same_object"].append(C.broadcast(b, src=world - 1) is b)
    out["broadcast"] = b.tolist()

    parts = [torch.empty(2) for _ in range(world)]
    ptrs = [p.data_ptr() for p in parts]
    got = C.all_gather(parts, torch.full((2,), float(rank)))
    out["same_object"].append(got is parts and [p.data_ptr() for p in parts] == ptrs)
    out["all_gather"] = [p.tolist() for p in parts]

    flat = torch.empty(2 * world)
    C.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = flat.tolist()

    # rank r sends r + 1 rows to every rank: uneven splits, as expert parallelism routes them
    send = torch.arange(world * (rank + 1), dtype=torch.float32) + 100 * rank
    recv = torch.empty(sum(q + 1 for q in range(world)))
    C.all_to_all_single(recv, send, [q + 1 for q in range(world)], [rank + 1] * world)
    out["all_to_all_single"] = recv.tolist()

    # the autograd wrappers over all_to_all_single: forward and the reverse exchange in backward
    x = (torch.arange(4 * world, dtype=torch.float32).reshape(world * 2, 2) + 10 * rank).requires_grad_()
    y = ulysses.all_to_all(x, 0, 0, sub)
    (y * (rank + 1)).sum().backward()
    out["ulysses"], out["ulysses_grad"] = y.tolist(), x.grad.tolist()
    z = torch.ones(world, 2, requires_grad=True)
    w = expert_parallel.all_to_all(z, [1] * world, [1] * world, sub)
    (w * 2).sum().backward()
    out["ep_grad"] = z.grad.tolist()

    obj = C.broadcast_object_list([{"from": rank}], src=0)
    out["broadcast_object_list"] = obj[0]
    table = C.all_gather_object([None] * world, ("r", rank))
    out["all_gather_object"] = table
    gathered = C.gather_object(rank * 10, [None] * world if rank == 0 else None, dst=0)
    out["gather_object"] = gathered
    out["scatter_object_list"] = C.scatter_object_list([None], [f"to{q}" for q in range(world)] if rank == 0
                                                       else None, src=0)[0]
    out["broadcast_obj"] = broadcast_obj({"k": rank}, src=0)

    owner = world - 1
    mine = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + rank if rank == owner else None
    got = send_to_rank0(mine, owner) if rank in (0, owner) else None
    out["send_to_rank0"] = None if got is None else (got.tolist(), str(got.dtype), got.device.type)
    C.barrier()
    C.barrier(group=sub)
    return out


def _rank_main(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from areal_cli.utils.dist import destroy_distributed, init_distributed

    init_distributed("gloo")
    try:
        res = _exercise(rank, world)
    except Exception as e:  # the parent shows it, instead of waiting for a missing result
        res = {"error": repr(e)}
    q.put((rank, res))
    destroy_distributed()


def test_helpers_on_one_gloo_rank():
    res = run_ranks(_rank_main, 1)[0]
    assert "error" not in res, res
    assert res["backend"] == "gloo" and all(res["same_object"])
    assert res["all_reduce"] == [1.0] * 3 and res["all_reduce_max"] == [0.0]
    assert res["all_gather"] == [[0.0, 0.0]] and res["all_to_all_single"] == [0.0]
    assert res["ulysses_grad"] == [[1.0, 1.0]] * 2 and res["ep_grad"] == [[2.0, 2.0]]
    assert res["broadcast_object_list"] == {"from": 0} and res["gather_object"] == [0]
    assert res["scatter_object_list"] == "to0" and res["send_to_rank0"] == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                                                                            "torch.bfloat16", "cpu")


def test_helpers_on_two_gloo_ranks():
    res = run_ranks(_rank_main, 2)
    assert all("error" not in r for r in res.values()), res
    r0, r1 = res[0], res[1]
    for r in (r0, r1):
        assert r["backend"] == "gloo" and all(r["same_object"]), r["same_object"]
        assert r["all_reduce"] == [3.0] * 3 and r["all_reduce_max"] == [1.0]
        assert r["broadcast"] == [1.0, 1.0]
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert r["broadcast_object_list"] == {"from": 0} and r["broadcast_obj"] == {"k": 0}
        assert r["all_gather_object"] == [("r", 0), ("r", 1)]
    # rank 0 sent [0, 1] (1 row each), rank 1 sent [100..103] (2 rows each)
    assert r0["all_to_all_single"] == [0.0, 100.0, 101.0] and r1["all_to_all_single"] == [1.0, 102.0, 103.0]
    # ulysses: each rank's first/second half of dim 0 goes to rank 0/1; the gradient comes back scaled by the
    # receiver's factor (rank + 1)
    assert r0["ulysses"] == [[0.0, 1.0], [2.0, 3.0], [10.0, 11.0], [12.0, 13.0]]
    assert r1["ulysses"] == [[4.0, 5.0], [6.0, 7.0], [14.0, 15.0], [16.0, 17.0]]
    assert r0["ulysses_grad"] == r1["ulysses_grad"] == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2
    assert r0["ep_grad"] == r1["ep_grad"] == [[2.0, 2.0]] * 2
    assert r0["gather_object"] == [0, 10] and r1["gather_object"] is None
    assert (r0["scatter_object_list"], r1["scatter_object_list"]) == ("to0", "to1")
    assert r0["send_to_rank0"] == ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "torch.bfloat16", "cpu")
    assert r1["send_to_rank0"] is None
