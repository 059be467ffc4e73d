"""engines/sharded_vocab.py on three real gloo ranks: a tied table cut unevenly by rows (11 rows: 4, 4, 3), ranks
with different token counts (one with none), a padding row and a sampling mask give every rank's logprobs,
entropies, and the table's gradient the one-process tied embedding and head give (the sum of the ranks'
losses), while each rank holds only its rows; and nothing in the lookup, the head or their backward has a
size that depends on the data (a GPU would wait for its stream to learn it, once per micro-batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gloo_ranks import run_ranks

V, H, T, PAD = 11, 5, 0.8, 2
COUNTS = (5, 0, 3)  # tokens per rank


def _data_dependent_ops():
    """A dispatch mode listing the ops whose output size or value the host must read off the tensor:
    ``nonzero``, ``masked_select``, ``item`` and indexing with a boolean mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    always = {aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default,
              aten.item.default}
    by_mask = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            idx = args[1] if func in by_mask and len(args) > 1 else ()
            if func in always or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return Seen()


def _case():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, H, generator=g)
    mix = torch.randn(H, H, generator=g)  # the "decoder" between the lookup and the head
    ids = [torch.randint(0, V, (n,), generator=g) for n in COUNTS]
    ids[0][1] = PAD
    tgt = [torch.randint(0, V, (n,), generator=g) for n in COUNTS]
    cut = [torch.full((n,), -0.5) for n in COUNTS]  # keep the columns whose z = logit / T is >= -0.5
    weights = [torch.randn(n, generator=g) for n in COUNTS]
    return table, mix, ids, tgt, cut, weights


def _rank_main(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from areal_cli.engines.sharded_vocab import ShardedTable

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    table, mix, ids, tgt, cut, weights = _case()
    param = torch.nn.Parameter(distribute_tensor(table, mesh, [Shard(0)]))
    st = ShardedTable(param, None)
    with _data_dependent_ops() as seen:
        hidden = torch.tanh(st.lookup(ids[rank][None], PAD)[0] @ mix)
        lp, ent = st.logprobs_entropy(hidden, tgt[rank], T, cut[rank])
        ((lp * weights[rank]).sum() + 0.3 * ent.sum()).backward()
    # lists: a tensor on the queue would be shared memory its process frees on exit
    q.put((rank, {"lp": lp.tolist(), "ent": ent.tolist(), "local_rows": param.to_local().shape[0],
                  "start": st.start, "grad": param.grad.full_tensor().tolist(),
                  "data_dependent": tuple(seen.ops)}))
    dist.barrier()
    dist.destroy_process_group()


def test_row_sharded_table_equals_the_one_process_tied_head():
    from areal_cli.engines.sampling_mask import masked_logprobs_entropy

    got = {r: {k: torch.tensor(v) if isinstance(v, list) else v for k, v in res.items()}
           for r, res in run_ranks(_rank_main, 3).items()}
    table, mix, ids, tgt, cut, weights = _case()
    ref = table.clone().requires_grad_(True)
    loss = 0.0
    for r in range(3):
        hidden = torch.tanh(F.embedding(ids[r], ref, padding_idx=PAD) @ mix)
        lp, ent = masked_logprobs_entropy(F.linear(hidden, ref), tgt[r], T, cut[r])
        assert got[r]["lp"].shape == lp.shape == (COUNTS[r],)
        assert torch.allclose(got[r]["lp"], lp, atol=1e-5, rtol=0), r
        assert torch.allclose(got[r]["ent"], ent, atol=1e-5, rtol=0), r
        loss = loss + (lp * weights[r]).sum() + 0.3 * ent.sum()
    loss.backward()
    assert [got[r]["local_rows"] for r in range(3)] == [4, 4, 3]
    assert [got[r]["start"] for r in range(3)] == [0, 4, 8]
    assert all(got[r]["data_dependent"] == () for r in range(3)), {r: got[r]["data_dependent"] for r in range(3)}
    for r in range(3):
        assert (got[r]["grad"] - ref.grad).abs().max() <= 1e-5, r
    assert ref.grad.abs().sum() > 0
