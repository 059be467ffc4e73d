"""``algo=rm``: reward-model training with the Bradley–Terry loss on preference pairs.

The model is the engine's critic (``build_engine(critic=True)``: a value head on the policy's architecture,
on every engine with a critic path); a step is :func:`areal_cli.algorithms.reward_model.rm_step`. The loop
is the SFT loop's: every rank draws the same deterministic stream of pairs, each data-parallel replica
trains its own slice of each batch, recover states and HF exports on the trainer's cadence. The eval is the
held-out pairwise accuracy (the share of test pairs whose chosen side scores higher), logged as
``eval/pairwise_accuracy`` with ``eval/loss`` and ``eval/margin``; it needs no inference server.

Every HF export is a critic dir the engines reload (``value_head.safetensors``) that also loads with
``transformers.AutoModelForSequenceClassification`` (trainer/reward_export.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from areal_cli.errors import DataError
from areal_cli.job.layout import JobLayout
from areal_cli.rollout.data_stream import PromptStream
from areal_cli.rollout import build as rollout_build
from areal_cli.trainer import build

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

EVAL_CHUNK = 64  # pairs per evaluation forward


def build_pair_splits(cfg: ExperimentConfig, tokenizer: Any) -> tuple[list[dict], list[dict]]:
    """(train pairs, held-out pairs) per the ``dataset`` group (data/preferences.py)."""
    import logging

    from areal_cli.data.preferences import load_pairs

    log = logging.getLogger(__name__)
    train = load_pairs(cfg.dataset, tokenizer, "train", cfg.seed)
    if train is None or not train[0]:
        raise DataError(f"dataset.train_path={cfg.dataset.train_path} yielded no preference pairs")
    test = load_pairs(cfg.dataset, tokenizer, "test", cfg.seed)
    for split in (train, test):
        if split is not None and split[1].n_skipped:
            log.warning("preference pairs %s", split[1].summary())
    pairs = test[0] if test is not None else []
    if cfg.dataset.eval_size is not None:
        pairs = pairs[: cfg.dataset.eval_size]
    return train[0], pairs


def evaluate_pairs(engine: Any, pairs: list[dict], read_id: int) -> dict[str, float]:
    """Held-out pairwise accuracy, Bradley–Terry loss and mean margin over ``pairs`` (each data-parallel
    replica scores its slice; the sums are reduced). Collective over the trainer's ranks."""
    from areal_cli.algorithms.reward_model import make_pair_batch, pair_stats, sequence_rewards

    import torch

    mine = pairs[engine.dp_rank::engine.dp_world_size]
    # every replica runs the same number of forwards (the engines' collectives), padding with its own first pair
    n_chunks = -(-len(pairs[0::engine.dp_world_size]) // EVAL_CHUNK)
    rewards = []
    for i in range(n_chunks):
        chunk = mine[i * EVAL_CHUNK:(i + 1) * EVAL_CHUNK]
        batch = make_pair_batch(chunk or mine[:1] or pairs[:1], read_id, read_id)
        r = sequence_rewards(engine.forward(batch, output="values")["values"], batch["attention_mask"])
        if chunk:
            rewards.append(r)
    stats = pair_stats(engine, torch.cat(rewards) if rewards else torch.zeros(0))
    return {"eval/pairwise_accuracy": stats["rm/accuracy"], "eval/loss": stats["rm/loss"],
            "eval/margin": stats["rm/margin"], "eval/pairs": stats["rm/pairs"]}


def run_rm_steps(engine: Any, stream: PromptStream, read_id: int, *, steps: int, batch_size: int, stats: Any,
                 first_step: int, total: int) -> dict[str, float]:
    from areal_cli.algorithms.reward_model import make_pair_batch, rm_step

    last: dict[str, float] = {}
    for step in range(first_step, first_step + steps):
        t0 = time.perf_counter()
        items = stream.take(batch_size)
        stream.mark_consumed([it.pos for it in items])
        mine = items[engine.dp_rank::engine.dp_world_size]  # every rank of a replica trains its replica's pairs
        batch = make_pair_batch(mine, read_id, read_id)
        last = rm_step(engine, batch, len(items))
        dt = time.perf_counter() - t0
        last["perf/train_tokens_per_s"] = float(batch["attention_mask"].sum()) * engine.dp_world_size / max(dt, 1e-9)
        last["perf/step_s"] = dt
        stats.log("rm", step, {**{k: v for k, v in last.items() if v is not None}, "total": int(total)})
    return last


def run_rm(cfg: ExperimentConfig, layout: JobLayout, run_dir: str, model_path: str, rank: int,
           world: int) -> dict[str, Any]:
    """``algo=rm``: ``trainer.total_steps`` Bradley–Terry steps of ``algo.batch_size`` pairs, evaluated on the
    held-out pairs every ``trainer.eval_every`` steps and at the end; exports as ``algo=sft`` does."""
    from areal_cli.algorithms.reward_model import read_token_id
    from areal_cli.trainer.reward_export import write_sequence_classification
    from areal_cli.trainer.checkpoint import CheckpointManager, run_engine_loop
    from areal_cli.trainer.stats import StatsLogger
    from areal_cli.utils.dist import barrier, broadcast_obj

    tc = cfg.trainer
    stats = StatsLogger(run_dir, cfg.stats, experiment=cfg.experiment_name, trial=cfg.trial_name,
                        enabled=rank == 0)
    ckpt = CheckpointManager(run_dir, rank=rank, keep=tc.keep_checkpoints, tokenizer_path=model_path)
    tokenizer = rollout_build.build_tokenizer(model_path)
    read_id = read_token_id(tokenizer)
    train_pairs, test_pairs = build_pair_splits(cfg, tokenizer)
    if tc.sft_warmup_steps > 0:  # InstructGPT's recipe: the reward model starts from the SFT policy
        from areal_cli.trainer.sft import sft_warm_start

        train_items, _ = build.build_datasets(cfg, tokenizer)
        model_path = sft_warm_start(cfg, layout, run_dir, model_path, tokenizer, train_items, rank, world, stats)
    if len(train_pairs) < cfg.algo.batch_size:
        raise DataError(f"algo.batch_size: {cfg.algo.batch_size} pairs per step but only {len(train_pairs)} "
                        "train pairs — fix: lower algo.batch_size or add pairs")
    engine = build.build_engine(cfg, layout, model_path, critic=True)
    stream = PromptStream(train_pairs, seed=cfg.seed, shuffle=cfg.dataset.shuffle)
    start = ckpt.resume_loop(cfg.resume, engine, stream, stats, "rm", rank)
    if rank == 0:
        print(f"[areal] reward model: {len(train_pairs)} train pairs, {len(test_pairs)} held-out pairs", flush=True)

    def evaluate(step: int) -> dict[str, float]:
        if not test_pairs:
            return {}
        out = evaluate_pairs(engine, test_pairs, read_id)
        if rank == 0:
            stats.log("eval", step, {**out, "phase": "rm"})
            print(f"[areal] rm eval @ step {step}: pairwise accuracy {out['eval/pairwise_accuracy']:.1%} "
                  f"(loss {out['eval/loss']:.3f}, {int(out['eval/pairs'])} pairs)", flush=True)
        return broadcast_obj(out)

    def export(name: str) -> str:
        path = ckpt.export_hf(engine, name)
        if rank == 0:
            write_sequence_classification(path, pad_token_id=read_id)
        barrier()
        return path

    return run_engine_loop(tc, start, engine, ckpt, stream, stats, rank,
                           lambda first, n: run_rm_steps(engine, stream, read_id, steps=n, batch_size=cfg.algo.batch_size,
                                                        stats=stats, first_step=first, total=tc.total_steps),
                           evaluate, export)
