"""The trainer's actor on a dp=2 FSDP engine computes batch-level advantage statistics over the whole
step's batch, not per shard: two real gloo ranks, each holding half of the groups, give the same
advantages as one process holding the full batch."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

ALGOS = {  # preset overrides whose advantages depend on statistics of the whole batch
    "reinforce_pp": ["algo=reinforce_pp", "algo.kl_coef=0"],
    "grpo_batch_std": ["algo=grpo", "algo.std_level=batch", "algo.kl_coef=0"],
    "grpo_adv_norm": ["algo=grpo", "algo.adv_norm=true", "algo.kl_coef=0"],
}


def full_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    B, L = 8, 12
    ids = torch.randint(5, 200, (B, L), generator=g)
    mask = torch.zeros(B, L)
    mask[:, 4:] = (torch.rand(B, L - 4, generator=g) > 0.2).float()
    return {"input_ids": ids, "attention_mask": torch.ones(B, L, dtype=torch.bool), "loss_mask": mask,
            "logprobs": -torch.rand(B, L, generator=g) * mask,
            "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.2]),
            "versions": torch.where(mask.bool(), 0, -1)}


def advantages(model_dir: str, dp: int, rank: int) -> dict[str, list]:
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.plan.compose import load_config
    from areal_cli.engines import get_engine_cls
    from areal_cli.trainer import build

    out = {}
    batch = full_batch()
    if dp > 1:  # rank r holds groups r*2, r*2+1 (4 rows, group size 2)
        batch = {k: v[rank * 4:(rank + 1) * 4] for k, v in batch.items()}
    engine = None
    for name, overrides in ALGOS.items():
        cfg = load_config([*overrides, "rollout.group_size=2", "algo.batch_size=4"])
        if engine is None:  # the presets share the engine config; one engine serves them all
            engine = get_engine_cls("fsdp")(cfg.engine, cfg.algo.optim, total_steps=1)
            engine.initialize(ParallelStrategy(dp=dp), model_dir)
        actor = build.build_actor(cfg, engine, None)
        out[name] = actor.compute_advantages(batch)["advantages"].tolist()
    engine.destroy()
    return out


def _rank_main(rank: int, port: int, model_dir: str, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        q.put((rank, advantages(model_dir, 2, rank)))
    except BaseException as e:  # the parent fails at once instead of waiting for a result
        q.put((rank, repr(e)))
        raise


def test_batch_level_advantages_span_dp_ranks(tiny_model_dir):
    from areal_cli.utils.network import find_free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, tiny_model_dir, q)) for r in range(2)]
    for p in procs:
        p.start()
    shards = dict(q.get(timeout=300) for _ in procs)
    assert all(isinstance(v, dict) for v in shards.values()), shards
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    whole = _whole(tiny_model_dir)
    for name in ALGOS:
        got = torch.tensor(shards[0][name] + shards[1][name])
        torch.testing.assert_close(got, torch.tensor(whole[name]), rtol=1e-5, atol=1e-6, msg=name)


def _whole(model_dir: str) -> dict[str, list]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_whole_main, args=(model_dir, q))
    p.start()
    out = q.get(timeout=300)
    p.join(timeout=60)
    return out


def _whole_main(model_dir: str, q) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    q.put(advantages(model_dir, 1, 0))
