"""The row-sharded tied table (engines/sharded_vocab.py, ``engine.tied_head``) on CUDA: its lookup, head and
their backward make no host synchronisation (``torch.cuda.set_sync_debug_mode("error")`` raises on one), on
the ``cpu:gloo,cuda:nccl`` group the engines use, and give the dense tied embedding and head's logprobs and
table gradient. The CPU suite checks the arithmetic over three gloo ranks and that no op has a data-dependent
size (tests/unit/engines/test_sharded_vocab.py); what only a GPU shows is that the token counts' exchange
stays on the host instead of waiting for the stream, twice per micro-batch.
"""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks
from gpu_check import DEVICE, needs_cuda, record

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.timeout(300)]

V, H, N, PAD, T = 1000, 64, 300, 3, 0.7


def _case():
    g = torch.Generator().manual_seed(0)
    table, mix = torch.randn(V, H, generator=g) * 0.1, torch.randn(H, H, generator=g) * 0.3
    ids, tgt = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N,), generator=g)
    ids[7] = PAD
    return table, mix, ids, tgt


def _rank_main(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from areal_cli.engines.sharded_vocab import ShardedTable
    from areal_cli.utils.dist import process_group_backend

    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    backend = process_group_backend(None, cuda)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh(DEVICE, (world,))
    table, mix, ids, tgt = (t.to(DEVICE) for t in _case())
    param = torch.nn.Parameter(distribute_tensor(table, mesh, [Shard(0)]))
    st = ShardedTable(param, None)

    def step(sync_check: bool):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if sync_check else "default")
        try:
            hidden = torch.tanh(st.lookup(ids[None], PAD)[0] @ mix)
            lp, ent = st.logprobs_entropy(hidden, tgt, T, None)
            (lp.sum() + 0.3 * ent.sum()).backward()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        return lp, ent

    step(False)  # first calls: lazy CUDA and NCCL initialisation may synchronise
    param.grad = None
    error = None
    try:
        lp, ent = step(True)
    except RuntimeError as e:  # "called a synchronizing CUDA operation"
        error, lp, ent = str(e).splitlines()[0], None, None
    q.put((rank, {"error": error, "backend": backend,
                  "lp": None if lp is None else lp.detach().cpu().tolist(),
                  "ent": None if ent is None else ent.detach().cpu().tolist(),
                  "grad": None if param.grad is None else param.grad.full_tensor().cpu().tolist()}))
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_table_makes_no_host_sync(tmp_path):
    import torch.nn.functional as F

    got = run_ranks(_rank_main, 1, timeout=240)[0]
    record("sharded_vocab_no_sync", {"error": got["error"], "backend": got["backend"]}, tmp_path)
    assert got["error"] is None, f"the sharded table synchronised with the GPU: {got['error']}"
    table, mix, ids, tgt = _case()
    ref = table.clone().requires_grad_(True)
    hidden = torch.tanh(F.embedding(ids, ref, padding_idx=PAD) @ mix)
    logp = torch.log_softmax(F.linear(hidden, ref) / T, -1)
    lp = logp.gather(-1, tgt[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + 0.3 * ent.sum()).backward()
    assert (torch.tensor(got["lp"]) - lp).abs().max() <= 1e-4
    assert (torch.tensor(got["ent"]) - ent).abs().max() <= 1e-4
    assert (torch.tensor(got["grad"]) - ref.grad).abs().max() <= 1e-4
    assert ref.grad.abs().sum() > 0
