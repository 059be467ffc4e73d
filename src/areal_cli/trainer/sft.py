"""Supervised fine-tuning on the same engines: ``algo=sft`` runs, and the SFT → GRPO warm start.

An SFT example is ``prompt (chat template) + target + eos``; the loss is the token-mean negative
log-likelihood of the target and eos tokens (``algorithms.actor.sft_step``), normalised by
the global token count inside ``engine.train_batch``. Every rank draws the same deterministic
prompt stream; each data-parallel replica trains on its own slice of each batch (all ranks of a
replica on the same slice), so no data has to be scattered.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import DataError, InferenceError, WeightSyncError
from areal_cli.job.layout import JobLayout
from areal_cli.rollout.data_stream import PromptStream
from areal_cli.rollout import build as rollout_build
from areal_cli.trainer import build
from areal_cli.utils.dist import barrier, broadcast_obj
from areal_cli.weight_sync.fleet import ServerFleet
from areal_cli.weight_sync.publisher import PushTarget, WeightPublisher

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

SFT_DIRNAME = "sft_warmup"


def sft_target(item: dict[str, Any]) -> str:
    """What the model should answer for ``item``: the full ``solution`` (worked answer) when the
    dataset provides one, else ``answer``."""
    for key in ("target", "sft_target", "solution", "answer"):
        v = item.get(key)
        if isinstance(v, str) and v:
            return v
    raise DataError(f"SFT needs a 'target' or 'answer' string in every item (keys: {sorted(item)})")


def make_sft_batch(items: list[dict[str, Any]], tokenizer: Any, use_chat_template: bool = True) -> dict[str, Any]:
    """Right-padded ``input_ids``/``attention_mask``/``loss_mask`` for prompt+target+eos examples; items with
    images have their image pads expanded, and the batch then carries ``multi_modal`` (None for a text row)."""
    import torch

    from areal_cli.models.vl_inputs import item_prompt_images
    from areal_cli.rollout.workflows.common import build_prompt, encode

    rows = []
    mm: list[Any] = []
    for it in items:
        prompt = build_prompt(tokenizer, it, use_chat_template)
        vis = item_prompt_images(tokenizer, it, prompt.ids)
        mm.append(None if vis is None else vis.multi_modal)
        target = encode(tokenizer, sft_target(it))
        if tokenizer.eos_token_id is not None:
            target = target + [int(tokenizer.eos_token_id)]
        rows.append((list(prompt.ids) if vis is None else vis.ids, target))
    max_len = max(len(p) + len(t) for p, t in rows)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    ids = torch.full((len(rows), max_len), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), max_len), dtype=torch.bool)
    mask = torch.zeros((len(rows), max_len), dtype=torch.float32)
    for i, (p, t) in enumerate(rows):
        n = len(p) + len(t)
        ids[i, :n] = torch.tensor(p + t)
        attn[i, :n] = True
        mask[i, len(p):n] = 1.0
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    if any(m is not None for m in mm):
        batch["multi_modal"] = mm
    return batch


def run_sft_steps(engine: Any, stream: PromptStream, tokenizer: Any, *, steps: int, batch_size: int,
                  stats: Any, use_chat_template: bool = True, kind: str = "sft", first_step: int = 1,
                  total: int | None = None) -> dict[str, float]:
    """``steps`` optimizer steps; logs ``sft/loss`` per step (with ``total``, the phase's step count, so a
    reader of ``metrics.jsonl`` can show step/total and an ETA). Returns the last step's stats."""
    from areal_cli.algorithms.actor import sft_step
    from areal_cli.utils.procs import freeze_heap

    freeze_heap()
    last: dict[str, float] = {}
    for step in range(first_step, first_step + steps):
        t0 = time.perf_counter()
        items = stream.take(batch_size)
        stream.mark_consumed([it.pos for it in items])
        mine = items[engine.dp_rank::engine.dp_world_size]  # every rank of a replica trains its replica's items
        batch = make_sft_batch(mine, tokenizer, use_chat_template)
        out = sft_step(engine, batch)
        dt = time.perf_counter() - t0
        tokens = float(batch["attention_mask"].sum()) * engine.dp_world_size
        last = {"sft/loss": float(out.get("loss", out.get("nll", 0.0))), "sft/lr": out.get("lr"),
                **({"sft/image_rows": float(sum(m is not None for m in batch["multi_modal"]))}
                   if "multi_modal" in batch else {}),
                "sft/grad_norm": out.get("grad_norm"), "perf/train_tokens_per_s": tokens / max(dt, 1e-9),
                "perf/step_s": dt}
        rec = {k: v for k, v in last.items() if v is not None}
        stats.log(kind, step, rec if total is None else {**rec, "total": int(total)})
    return last


def sft_warm_start(cfg: ExperimentConfig, layout: JobLayout, run_dir: str, model_path: str, tokenizer: Any,
                   train_items: list[dict], rank: int, world: int, stats: Any) -> str:
    """Run ``trainer.sft_warmup_steps`` of SFT and export HF weights; the RL phase starts from them.

    Cached: a finished warm start (``<run_dir>/sft_warmup/done.json``) is reused, so a resumed run
    does not repeat it. A warm start killed midway is redone from scratch (it is deterministic).
    """
    out_dir = Path(run_dir) / SFT_DIRNAME / "hf"
    done = Path(run_dir) / SFT_DIRNAME / "done.json"
    if done.exists():
        return str(out_dir)
    tc = cfg.trainer
    optim = dataclasses.replace(cfg.algo.optim, lr=tc.sft_lr, lr_scheduler="constant", warmup_steps=0)
    # Under model.lora the warm start still trains every weight; the adapter is the RL phase's.
    engine = build.build_engine(cfg, layout, model_path, optim=optim, total_steps=tc.sft_warmup_steps,
                                lora=False)
    from areal_cli.rollout.workflows import resolve_workflow

    sft_items = getattr(resolve_workflow(cfg.workflow.name), "sft_items", None)
    if sft_items is not None:  # an agent task renders its own prompts (with tools) and transcripts
        train_items = sft_items(cfg, tokenizer, train_items)
    stream = PromptStream(train_items, seed=cfg.seed + 17, shuffle=cfg.dataset.shuffle)
    t0 = time.perf_counter()
    # The inference servers idle during the warm start, so this node's trainer ranks may share its cores.
    from areal_cli.utils.concurrency import cores_per_rank, torch_threads

    with torch_threads(cores_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))):
        last = run_sft_steps(engine, stream, tokenizer, steps=tc.sft_warmup_steps,
                             batch_size=tc.sft_batch_size, stats=stats,
                             use_chat_template=cfg.dataset.use_chat_template, total=tc.sft_warmup_steps)
    from areal_cli.api.io_struct import SaveLoadMeta

    engine.save(SaveLoadMeta(path=str(out_dir), weight_format="hf", tokenizer_path=model_path))
    barrier()
    if rank == 0:
        done.write_text(json.dumps({"steps": tc.sft_warmup_steps, "time_s": time.perf_counter() - t0,
                                    "last": last}))
        print(f"[areal] SFT warm start: {tc.sft_warmup_steps} steps in {time.perf_counter() - t0:.1f}s, "
              f"loss {last.get('sft/loss', float('nan')):.3f}", flush=True)
    barrier()
    engine.destroy()
    return str(out_dir)


def _evaluate_surviving_restarts(cfg: ExperimentConfig, publisher: WeightPublisher, tokenizer: Any,
                                 items: list[dict], recs: list[dict], meta: Any,
                                 error: Exception | None) -> dict[str, float]:
    """Rank 0 of ``algo=sft``: evaluate the weights that ``meta`` pushed from disk. A server that dies
    during the push (``error``) or the evaluation is waited for; once the launcher has restarted it,
    every server loads the pushed dir again and the evaluation goes on where it stopped."""
    from areal_cli.trainer.evaluation import evaluate_on_servers
    from areal_cli.weight_sync.disk_layout import load_meta

    done: dict = {}  # completions scored so far, kept across a restart
    restarts = 0
    while True:
        if error is None:
            try:
                out = evaluate_on_servers(cfg, [r["address"] for r in recs], recs[0]["backend"], tokenizer,
                                          items, done=done)
                out["eval/server_restarts"] = float(restarts)
                return out
            except InferenceError as e:
                error = e
        pushed = load_meta(meta)  # the sender wrote this dir before the load that may have failed
        publisher.fleet.adopt(recs)
        new = publisher.fleet.await_restart()
        if new is None or not Path(pushed.path).is_dir():
            raise error
        print(f"[areal] evaluation at step {meta.version} lost a server ({error}); loading {pushed.path} "
              f"into the restarted server and going on ({len(done)} completions kept)", flush=True)
        recs, error, restarts = new, None, restarts + 1
        try:
            publisher.reload_from_disk(pushed, recs)
        except InferenceError as e:  # died again: wait for the next restart
            error = e


def run_sft(cfg: ExperimentConfig, layout: JobLayout, run_dir: str, model_path: str, rank: int,
            world: int) -> dict[str, Any]:
    """``algo=sft``: ``trainer.total_steps`` SFT steps with recover states and HF exports; evaluated
    through the inference servers (weights pushed from disk) when the allocation has any."""
    from areal_cli.job.address_book import read_servers, wait_for_servers
    from areal_cli.trainer.checkpoint import CheckpointManager, run_engine_loop
    from areal_cli.trainer.stats import StatsLogger

    tc = cfg.trainer
    stats = StatsLogger(run_dir, cfg.stats, experiment=cfg.experiment_name, trial=cfg.trial_name,
                        enabled=rank == 0)
    ckpt = CheckpointManager(run_dir, rank=rank, keep=tc.keep_checkpoints, tokenizer_path=model_path)
    tokenizer = rollout_build.build_tokenizer(model_path)
    train_items, test_items = build.build_datasets(cfg, tokenizer)
    if cfg.dataset.eval_size:
        test_items = test_items[: cfg.dataset.eval_size]
    engine = build.build_engine(cfg, layout, model_path)
    stream = PromptStream(train_items, seed=cfg.seed, shuffle=cfg.dataset.shuffle)
    start = ckpt.resume_loop(cfg.resume, engine, stream, stats, "sft", rank)
    has_servers = bool(layout.servers)
    # Only disk pushes: the servers idle between evaluations, so no broadcast group is kept for them.
    fleet = ServerFleet(run_dir, len(layout.servers), cfg.launcher.server_startup_timeout_s,
                        read=read_servers, wait=wait_for_servers, connect=functools.partial(rollout_build.build_client, cfg))
    publisher = WeightPublisher(fleet, "disk", rank=rank, target=PushTarget(1 + len(layout.servers), None, "gloo"),
                                lora=False, model_path=model_path)

    def evaluate(step: int) -> dict[str, float]:
        if not has_servers or not test_items:
            return {}
        from areal_cli.weight_sync.disk_layout import disk_update_meta, prune_pushed

        recs = fleet.wait() if rank == 0 else []
        client = fleet.client_for(recs) if rank == 0 else None
        meta = disk_update_meta(run_dir, step)
        error: Exception | None = None
        try:
            engine.update_weights(meta, [client] if client is not None else [])
        except WeightSyncError as e:  # raised on every rank; rank 0 retries the load from disk below
            error = e
        out = {}
        if rank == 0:
            prune_pushed(meta.path, keep=1)  # every server has loaded this step's weights (or will, from it)
            out = _evaluate_surviving_restarts(cfg, publisher, tokenizer, test_items, recs, meta, error)
            stats.log("eval", step, {**out, "phase": "sft"})  # an SFT run's evaluations, not an RL phase's
        return broadcast_obj(out)

    return run_engine_loop(tc, start, engine, ckpt, stream, stats, rank,
                           lambda first, n: run_sft_steps(engine, stream, tokenizer, steps=n, batch_size=cfg.algo.batch_size, stats=stats,
                                                         use_chat_template=cfg.dataset.use_chat_template,
                                                         first_step=first, total=tc.total_steps),
                           evaluate, lambda name: ckpt.export_hf(engine, name))
