"""The asynchronous RL loop (GRPO, PPO, DAPO, ... — whatever ``algo`` configures).

Rank 0 (the data-parallel head) owns the rollout side: executor, client, workflow and prompt
stream, in a worker process by default (``rollout/worker.py``). Every step it takes one batch of
finished episodes and splits it by episode across the trainer ranks; all ranks then compute
logprobs / advantages and run the PPO update. After the update the version
is bumped and the weights are pushed to the servers (pause → sync → continue) while the executor
keeps its in-flight episodes (they resume on the new weights, tokens tagged with their version).

Order inside one step, and why:
1. batch ← executor (staleness-bounded); the consumed prompt positions are recorded.
2. logp / ref logp / advantages / update (collective over the ranks).
3. version += 1; push weights; only then tell the executor the new version, so in synchronous
   mode (max_head_offpolicyness=0) nothing for the next step is admitted before step 4.
4. recover state / HF export / eval / log.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.inference.push_mode import resolved_weight_update
from areal_cli.job.address_book import read_servers, wait_for_servers
from areal_cli.job.layout import JobLayout
from areal_cli.rollout import build as rollout_build
from areal_cli.trainer import build
from areal_cli.trainer.checkpoint import CheckpointManager
from areal_cli.trainer.stats import StatsLogger
from areal_cli.utils.concurrency import StepThreads, cores_per_rank, torch_threads
from areal_cli.utils.dist import broadcast_obj
from areal_cli.utils.procs import freeze_heap
from areal_cli.weight_sync.fleet import ServerFleet
from areal_cli.weight_sync.publisher import PushTarget, WeightPublisher

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def dp_rank_table(engine: Any) -> list[int]:
    """The data-parallel rank of every global rank (collective; once per engine)."""
    dist = _dist()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [engine.dp_rank]
    from areal_cli.utils import collectives

    table: list[Any] = [None] * dist.get_world_size()
    collectives.all_gather_object(table, int(engine.dp_rank))
    return [int(r) for r in table]


def scatter_batch(batch: dict[str, Any] | None, n_episodes: int, dp_of_rank: list[int]) -> dict[str, Any]:
    """Rank 0 splits ``batch`` (rows grouped by episode) into one equal run of episodes per
    data-parallel replica; every rank of a replica (its tp/pp/cp ranks) receives that replica's run.

    Splitting over the global world instead would hand the ranks of one replica different episodes,
    and an engine that makes them agree (the replica's head wins) would silently drop the rest.
    """
    world = len(dp_of_rank)
    if world == 1:
        if batch is None:
            raise RuntimeError("internal: rank 0 has no batch to train on")
        return batch
    dist = _dist()
    parts: list[Any] | None = None
    if dist.get_rank() == 0:
        if batch is None:
            raise RuntimeError("internal: rank 0 has no batch to train on")
        from areal_cli.rollout.worker import episode_slices

        dp = max(dp_of_rank) + 1
        spans, eps_per_dp = episode_slices(batch, n_episodes), n_episodes // dp
        # episodes may differ in rows (agent episodes): each replica gets whole episodes
        runs = [{k: v[spans[r * eps_per_dp][0]:spans[(r + 1) * eps_per_dp - 1][1]] for k, v in batch.items()}
                for r in range(dp)]
        parts = [runs[d] for d in dp_of_rank]
    from areal_cli.utils import collectives

    return collectives.scatter_object_list([None], parts, src=0)[0]


def step_threads(cfg: ExperimentConfig, layout: JobLayout, rank: int) -> StepThreads | None:
    """CPU: the RL step's threads follow the bottleneck (StepThreads) on this rank's share of its node's
    cores, shared with the inference servers when the layout puts servers on the rank's node. The node
    runner (local, SLURM, SkyPilot) hands its node's cores to its processes; Ray's actors hold the CPUs Ray
    granted them, so they keep the process's thread count. ``launcher.trainer_env.AREAL_TRAIN_THREADS=N``
    (a user's knob) sets the share under any launcher (1: one thread). CUDA: None, the count stays as set."""
    if cfg.cluster.device != "cpu":
        return None
    most = os.environ.get("AREAL_TRAIN_THREADS")
    if most is None:
        if cfg.launcher.name == "ray":
            return None
        most = cores_per_rank(layout.trainer.nproc_per_node)
        if most <= 1:
            return None
    return StepThreads(int(most), sync=int(cfg.rollout.max_head_offpolicyness) == 0,
                       shared=bool(layout.servers_on(layout.trainer.node_of(rank))))


class RLTrainer:
    """One trainer rank of an RL run. ``run()`` is collective over all ranks."""

    def __init__(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str, model_path: str, rank: int,
                 world: int):
        self.cfg, self.layout, self.run_dir = cfg, layout, run_dir
        self.model_path = model_path
        self.rank, self.world = rank, world
        self.total_steps = int(cfg.trainer.total_steps)
        self.stats = StatsLogger(run_dir, cfg.stats, experiment=cfg.experiment_name, trial=cfg.trial_name,
                                 enabled=rank == 0)
        self.ckpt = CheckpointManager(run_dir, rank=rank, keep=cfg.trainer.keep_checkpoints,
                                      tokenizer_path=model_path)
        self.weight_mode = resolved_weight_update(
            cfg.rollout.weight_update, [sp.backend for sp in layout.servers], rollout_build.lora_enabled(cfg),
            shared_gpu=layout.colocated and cfg.cluster.device == "cuda")
        self.fleet = ServerFleet(run_dir, len(layout.servers), float(cfg.launcher.server_startup_timeout_s),
                                 read=read_servers, wait=wait_for_servers,
                                 connect=functools.partial(rollout_build.build_client, cfg))
        target = PushTarget(world_size=1 + sum(sp.tp for sp in layout.servers),
                            dtype=cfg.rollout.weight_update_dtype,
                            backend="nccl" if layout.device == "cuda" else "gloo")
        self.publisher = WeightPublisher(self.fleet, self.weight_mode, rank=rank, target=target,
                                         lora=rollout_build.lora_enabled(cfg), model_path=model_path)
        self.rollout: Any = None  # RolloutService or RolloutProcess (rank 0)
        self.critic = None
        self.scorer: Any = None  # workflow.reward_model (algorithms/rm_reward.py)
        self.weight_sync_s = 0.0
        self.elapsed_before = 0.0  # wall time of earlier (resumed) segments
        self.t_start = time.time()
        self.threads = step_threads(cfg, layout, rank)

    # ------------------------------------------------------------------ setup
    def _setup_rollout(self, train_items: list[dict]) -> None:
        from areal_cli.rollout.worker import start_rollout

        recs = self.fleet.open_control({sp.index: sp.tp for sp in self.layout.servers})
        addresses = [r["address"] for r in recs]
        self.rollout = start_rollout(self.cfg, addresses, recs[0].get("backend", "hf"), self.model_path,
                                     train_items, self.run_dir)
        self.fleet.listeners.append(self.rollout.set_addresses)
        self.publisher.before_push = self.rollout.pause

    def next_batch(self, engine: Any, version: int) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """Collective wait for the next batch; syncs restarted servers while waiting."""
        while True:
            status, batch, stats = "wait", None, {}
            if self.rank == 0:
                if self.fleet.pending() and self.fleet.complete():
                    status = "sync"
                else:
                    got = self.rollout.next_batch(2.0)
                    if got is not None:
                        batch, stats, status = got["data"], got["stats"], "ok"
            status = broadcast_obj(status)
            if status == "ok":
                return batch, stats
            if status == "sync":
                self.publisher.sync_restarted(engine, version)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tokenizer: Any, test_items: list[dict], step: int, phase: str = "rl",
                 engine: Any | None = None) -> dict[str, float]:
        """Collective: held-out evaluation through the servers (rank 0 runs it).

        A server that dies meanwhile is handled as in rollouts: once the launcher has restarted it,
        it is brought to ``engine``'s weights (``WeightPublisher.sync_restarted``) and the evaluation goes on where it
        stopped (completions already scored are kept). Without ``engine`` (the base model's
        evaluation, before any training) the restarted server already serves the evaluated weights.
        """
        from areal_cli.errors import InferenceError
        from areal_cli.trainer.evaluation import evaluate_on_servers

        if not test_items:
            return {}
        out: dict[str, float] = {}
        done: dict = {}  # rank 0: completions scored so far, kept across a server restart
        restarts = 0
        t0 = time.perf_counter()
        while True:
            status = "ok"
            if self.rank == 0:
                recs = self.fleet.wait()
                if not self.fleet.epochs:  # the base evaluation runs before the rollout side exists
                    self.fleet.adopt(recs)
                if self.fleet.pending():
                    status = "sync"  # restarted since the last sync: it holds the base weights
                else:
                    try:
                        out = evaluate_on_servers(self.cfg, [r["address"] for r in recs],
                                                  recs[0].get("backend", "hf"), tokenizer, test_items,
                                                  executor=self.rollout, done=done, base=phase == "base")
                    except InferenceError as e:
                        if self.fleet.await_restart() is None:
                            raise
                        print(f"[areal] evaluation at step {step} lost a server ({e}); going on on the "
                              f"restarted server ({len(done)} completions kept)", flush=True)
                        status = "sync"
            if broadcast_obj(status) == "ok":
                break
            restarts += 1
            if engine is not None:
                self.publisher.sync_restarted(engine, engine.get_version())
            elif self.rank == 0:
                self.fleet.adopt(self.fleet.records())
        if self.rank == 0:
            out["eval/time_s"] = time.perf_counter() - t0
            out["eval/server_restarts"] = float(restarts)
            self.stats.log("eval", step, {**out, "phase": phase})
        return broadcast_obj(out)

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        import torch

        cfg = self.cfg
        tokenizer = rollout_build.build_tokenizer(self.model_path)
        train_items, test_items = build.build_datasets(cfg, tokenizer)
        if cfg.dataset.eval_size:
            test_items = test_items[: cfg.dataset.eval_size]
        recover = self.ckpt.find_recover(cfg.resume)
        state = broadcast_obj(_peek_state(recover) if self.rank == 0 else None)
        self.stats.log("event", 0, {"event": "start", "resumed_from": state["step"] if state else 0})

        policy_path = self.model_path
        if cfg.trainer.sft_warmup_steps > 0:
            from areal_cli.trainer.sft import SFT_DIRNAME, sft_warm_start

            if state is None and not (Path(self.run_dir) / SFT_DIRNAME / "done.json").exists():
                base = self.evaluate(tokenizer, test_items, 0, phase="base")
                if self.rank == 0 and base:
                    print(f"[areal] held-out accuracy of the base model: {base.get('eval/pass@1', 0):.1%}",
                          flush=True)

            policy_path = sft_warm_start(cfg, self.layout, self.run_dir, self.model_path, tokenizer,
                                         train_items, self.rank, self.world, self.stats)
        random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed + self.rank)

        self.publisher.policy_path = policy_path
        engine = build.build_engine(cfg, self.layout, policy_path)
        ref_engine = build.build_reference(cfg, self.layout, policy_path, engine)
        teacher_engine = build.build_teacher(cfg, self.layout, self.model_path, peers=(engine, ref_engine))
        actor = build.build_actor(cfg, engine, ref_engine, teacher_engine)
        self.scorer = build.build_reward_model(cfg, self.layout, self.model_path, tokenizer,
                                               peers=(engine, ref_engine, teacher_engine))
        self.dp_of_rank = dp_rank_table(engine)
        critic_engine = None
        if cfg.algo.use_critic:
            optim = dataclasses.replace(cfg.algo.optim, lr=cfg.algo.critic_lr)
            critic_engine = build.build_engine(cfg, self.layout, policy_path, optim=optim, critic=True,
                                               peers=(engine, ref_engine, teacher_engine,
                                                      getattr(self.scorer, "engine", None)))
            self.critic = build.build_critic(cfg, critic_engine)
        start_step = 0
        if recover is not None:
            state = self.ckpt.load_recover(engine, recover, self._others(critic_engine))
            start_step = int(state["step"])
            self.elapsed_before = float(state.get("elapsed_s", 0.0))
            self.stats.truncate_after(start_step)
            if self.rank == 0:
                print(f"[areal] resuming from step {start_step} (checkpoint {recover})", flush=True)
        engine.set_version(start_step)

        if self.rank == 0:
            self._setup_rollout(train_items)
            if state is not None:
                self.rollout.load_state_dict({"stream": state["stream"], "executor": state["executor"]})
        if start_step > 0 or policy_path != self.model_path or rollout_build.lora_enabled(cfg):
            # The servers started from the base weights; bring them to the trainer's policy (under
            # LoRA: load the adapter, which every request names, even at step 0).
            self.publisher.push_initial(engine, start_step)
        if self.rollout is not None:
            self.rollout.set_version(start_step)
            self.rollout.resume()

        engine.warm_up()  # overlaps the servers' first batch (or the evaluation below)
        if start_step == 0:
            phase = "sft" if policy_path != self.model_path else "rl"
            before = self.evaluate(tokenizer, test_items, 0, phase=phase, engine=engine)
            if self.rank == 0 and before:
                print(f"[areal] held-out accuracy before RL: {before.get('eval/pass@1', 0):.1%}", flush=True)
        freeze_heap()
        t_start = self.t_start = time.time()
        for step in range(start_step + 1, self.total_steps + 1):
            self.train_step(engine, actor, step, t_start, start_step)
            self._periodic(engine, tokenizer, test_items, step)
        final = self.evaluate(tokenizer, test_items, self.total_steps, engine=engine)
        if self.rank == 0 and final:
            print(f"[areal] held-out accuracy after RL: {final.get('eval/pass@1', 0):.1%}", flush=True)
        out = self.ckpt.export_hf(engine, "final")
        self._close_rollout()
        self.stats.log("event", self.total_steps, {"event": "end", "hf_export": out})
        self.stats.close()
        engine.destroy()
        for other in (ref_engine, teacher_engine, critic_engine, getattr(self.scorer, "engine", None)):
            if other is not None:
                other.destroy()
        return {"final_eval": final, "hf_export": out}

    def train_step(self, engine: Any, actor: Any, step: int, t_start: float, start_step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch, gen_stats = self.next_batch(engine, step - 1)
        if self.rank == 0:
            gen_stats["rollout/server_restarts"] = float(self.fleet.restarts_synced)
            _log_judge_samples(self.run_dir, step, gen_stats.pop("judge/samples", None))
        t_gen = time.perf_counter() - t0
        local = scatter_batch(batch, self.cfg.algo.batch_size, self.dp_of_rank)
        t1 = time.perf_counter()
        import torch

        threads = self.threads.n if self.threads is not None else torch.get_num_threads()
        with torch_threads(threads):
            train_stats = _ppo_step(actor, self.critic, local, self.scorer)
        t_train = time.perf_counter() - t1
        sync_s = self.publisher.push(engine, step)
        if self.rollout is not None:
            self.rollout.set_version(step)
            self.rollout.resume()
        gen_stats.pop("version", None)  # the executor's view; the step's policy version is `step`
        rec: dict[str, Any] = {**gen_stats, **{f"train/{k}" if "/" not in k else k: v
                                               for k, v in train_stats.items()}, "version": step}
        rec.update(_batch_stats(local, engine))
        step_s = time.perf_counter() - t0
        rec["perf/step_s"] = step_s
        rec["perf/gen_wait_s"] = t_gen
        rec["perf/train_s"] = t_train
        rec["perf/weight_sync_s"] = sync_s
        rec["perf/train_threads"] = float(threads)
        if self.threads is not None:
            self.threads.observe(t_gen, step_s)
        rec["weight_sync/disk"] = float(self.publisher.last_push_disk)  # 1: this step's push went through disk
        rec["perf/train_tokens_per_s"] = rec.pop("_tokens", 0.0) / max(t_train, 1e-9)
        rec["perf/gen_tokens_per_s"] = rec.pop("_gen_tokens", 0.0) / max(step_s, 1e-9)
        rec["perf/samples_per_s"] = rec.pop("_rows", 0.0) / max(step_s, 1e-9)
        rec["perf/elapsed_s"] = self.elapsed_before + time.time() - t_start
        self.stats.log("train", step, rec)
        return rec

    def _periodic(self, engine: Any, tokenizer: Any, test_items: list[dict], step: int) -> None:
        tc = self.cfg.trainer
        if tc.save_every and step % tc.save_every == 0 and step != self.total_steps:
            t0 = time.perf_counter()
            path = self.ckpt.export_hf(engine, f"step_{step:06d}")
            self.stats.log("event", step, {"event": "hf_export", "path": path, "seconds": time.perf_counter() - t0})
        if tc.recover_every and step % tc.recover_every == 0 and step != self.total_steps:
            t0 = time.perf_counter()
            path = self.ckpt.save_recover(engine, step, self._trainer_state(step) if self.rank == 0 else {},
                                          self._others(getattr(self.critic, "engine", None)))
            self.stats.log("event", step, {"event": "recover_save", "path": path,
                                           "seconds": time.perf_counter() - t0})
        if tc.eval_every and step % tc.eval_every == 0 and step != self.total_steps:
            self.evaluate(tokenizer, test_items, step, engine=engine)

    def _close_rollout(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        self.fleet.close()

    @staticmethod
    def _others(critic_engine: Any | None) -> dict[str, Any]:
        return {"critic": critic_engine} if critic_engine is not None else {}

    def _trainer_state(self, step: int) -> dict[str, Any]:
        return {"step": step, "version": step, **self.rollout.state_dict(), "weight_mode": self.weight_mode,
                "elapsed_s": self.elapsed_before + time.time() - self.t_start, "time": time.time()}


def _log_judge_samples(run_dir: Any, step: int, samples: list[dict] | None) -> None:
    """The LLM judge's recent verdicts (rewards/judge.py), one JSON line each, in the run's judge.jsonl."""
    if not samples:
        return
    import json

    with open(Path(run_dir) / "judge.jsonl", "a") as f:
        for rec in samples:
            f.write(json.dumps({"step": step, **rec}) + "\n")


def _peek_state(recover: Path | None) -> dict[str, Any] | None:
    import json

    if recover is None:
        return None
    return json.loads((recover / "trainer.json").read_text())


def _ppo_step(actor: Any, critic: Any | None, batch: dict[str, Any], scorer: Any | None = None) -> dict[str, float]:
    """reward-model scores (``workflow.reward_model``) → values (critic) → logp / ref logp / advantages → PPO
    mini-batch updates (actor, then critic)."""
    rm_stats: dict[str, float] = {}
    if scorer is not None:  # the combined reward replaces the rule's before any advantage reads it
        batch, rm_stats = scorer.score(batch)
    if critic is not None:
        batch = critic.compute_values(batch)
    batch = actor.compute_advantages(batch)
    stats = dict(actor.ppo_update(batch))
    if critic is not None:
        stats.update(critic.ppo_update(batch))
    stats.update(rm_stats)
    return stats


def _batch_stats(batch: dict[str, Any], engine: Any) -> dict[str, float]:
    """Reward/length stats of the step's batch: the local replica's run, summed over the data-parallel
    replicas (the tp/pp/cp ranks of one replica hold the same rows and are counted once)."""
    import torch

    from areal_cli.rewards.outcome import correct_counts

    rew = batch["rewards"].float()
    gen = batch["loss_mask"].float().sum(dim=1)
    vec = torch.tensor([rew.sum().item(), float(rew.numel()), gen.sum().item(),
                        float(batch["attention_mask"].sum().item()), *correct_counts(batch)],
                       dtype=torch.float64)
    s, n, g, tok, ok, known = engine.dp_all_reduce(vec).tolist()
    out = {"reward/mean": s / max(n, 1), "gen/mean_len": g / max(n, 1), "_tokens": tok, "_gen_tokens": g,
           "_rows": n}
    if known:  # correctness as the reward function stated it (rewards.outcome), over the rows that did
        out["reward/accuracy"] = ok / known
    if "multi_modal" in batch:  # rows that trained with their images (a vision-language run)
        k = float(sum(m is not None for m in batch["multi_modal"]))
        out["data/image_rows"] = engine.dp_all_reduce(torch.tensor([k], dtype=torch.float64)).item()
    if "agent_tool_calls" in batch:  # agent workflows: rows whose episode called a tool
        used = engine.dp_all_reduce(torch.tensor([float((batch["agent_tool_calls"] > 0).sum().item())],
                                                 dtype=torch.float64)).item()
        out["agent/tool_call_rate"] = used / max(n, 1)
    return out
