"""Batch-level statistics over data-parallel shards (a real 2-process gloo group) equal the
statistics of the whole batch in one process."""

from __future__ import annotations

import torch
from gloo_ranks import run_ranks

from areal_cli.algorithms.advantages import compute_advantages
from areal_cli.algorithms.normalisation import masked_whiten

G = 2  # group size; each rank holds whole groups


def full_batch():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (8,), generator=g).float()
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    mask[:, -1] = 1
    return rewards, mask


def estimates(rewards, mask, reduce=None):
    out = {}
    out["grpo_batch"] = compute_advantages("grpo", rewards=rewards, loss_mask=mask, group_size=G,
                                           mean_level="batch", std_level="batch", reduce=reduce)[0]
    out["grpo_group_batchstd"] = compute_advantages("grpo", rewards=rewards, loss_mask=mask, group_size=G,
                                                    mean_level="group", std_level="batch", reduce=reduce)[0]
    out["reinforce_pp"] = compute_advantages("reinforce_pp", rewards=rewards, loss_mask=mask, group_size=G,
                                             reduce=reduce)[0]
    out["reinforce_pp_baseline"] = compute_advantages("reinforce_pp_baseline", rewards=rewards, loss_mask=mask,
                                                      group_size=G, reduce=reduce)[0]
    out["whiten"] = masked_whiten(rewards[:, None] * mask, mask, reduce=reduce)
    return out


def _rank_main(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def allreduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    rewards, mask = full_batch()
    shard = slice(rank * 4, rank * 4 + 4)
    # Plain lists: torch shares tensors through fds that die with this process.
    q.put((rank, {k: v.tolist() for k, v in estimates(rewards[shard], mask[shard], reduce=allreduce).items()}))
    dist.barrier()
    dist.destroy_process_group()


def test_dp_reduced_statistics_equal_full_batch():
    results = run_ranks(_rank_main, 2)
    rewards, mask = full_batch()
    want = estimates(rewards, mask)
    local0 = estimates(rewards[:4], mask[:4])  # what a rank would compute without the reduction
    for key, full in want.items():
        got = torch.tensor(results[0][key] + results[1][key])
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0, msg=key)
    assert not torch.allclose(local0["grpo_batch"], want["grpo_batch"][:4])  # the reduction matters
