"""``areal plan``'s cost model: from a validated config, its plan and a hardware profile, the memory of every
component, the time of one RL step (sync and async), samples/s, utilisation per pool and the bottleneck.

Entry point: :func:`plan_config`. The terms live in ``timing.py`` (time) and ``memory.py`` (memory); this
module composes them the way the trainer loop runs a step (``trainer/rl.py:train_step``):

- wait for the step's batch (``perf/gen_wait_s``), then ``_ppo_step`` (``perf/train_s``), then push the
  weights (``perf/weight_sync_s``; generation is paused meanwhile: senders call ``pause_generation``);
- synchronous RL (``rollout.max_head_offpolicyness=0``) admits one batch per policy version, so the
  servers idle while the trainer trains: step = generation + reward + train + sync;
- asynchronous RL (k ≥ 1) generates the next batches while the trainer trains: step = max(generation +
  reward, train) + sync. On a CPU host the two share the cores (``shared_compute``): while both run each
  slows by demand/cores, so the overlap buys only what the spare cores allow;
- colocated allocations (trainer and servers on the same devices) never overlap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from areal_cli.allocation.estimate import ModelFacts
from areal_cli.inference.push_mode import resolved_weight_update
from areal_cli.planner import timing as T
from areal_cli.allocation.hardware import HardwareProfile
from areal_cli.planner.memory import ComponentMemory, server_memory, trainer_memory

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


@dataclass
class StepTimes:
    mode: str  # "sync" | "async": how this config runs
    step_s: float
    gen_s: float  # busy time of one server instance for the step's samples (prefill + decode + requests)
    prefill_s: float
    decode_s: float
    reward_s: float
    train_s: float
    sync_s: float
    sync_step_s: float  # the step if this config ran synchronously
    async_step_s: float  # ... and asynchronously under its staleness bound (k=1 when it is sync)
    gen_wait_s: float  # what perf/gen_wait_s should read: the part of the step spent waiting for the batch

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ComponentPlan:
    name: str
    kind: str  # "train" | "inference"
    backend: str
    dims: str
    n_devices: int
    utilisation: float
    memory: ComponentMemory
    busy_s: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        return d


@dataclass
class RunPlan:
    spec: str
    hardware: HardwareProfile
    step: StepTimes
    samples_per_s: float
    tokens_per_s: float  # generated tokens per second (the run's perf/gen_tokens_per_s)
    train_tokens_per_s: float  # prompt + completion tokens trained per second
    components: list[ComponentPlan]
    bottleneck: str
    warnings: list[str] = field(default_factory=list)
    workload: dict = field(default_factory=dict)
    terms: dict = field(default_factory=dict)  # the breakdown of each time term

    @property
    def fits(self) -> bool:
        return all(c.memory.fits for c in self.components)

    def to_dict(self) -> dict:
        return {"spec": self.spec, "hardware": self.hardware.to_dict(), "step": self.step.to_dict(),
                "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
                "train_tokens_per_s": self.train_tokens_per_s,
                "components": [c.to_dict() for c in self.components], "fits": self.fits,
                "bottleneck": self.bottleneck, "warnings": list(self.warnings), "workload": dict(self.workload),
                "terms": self.terms}


def _nodes(part) -> set[int]:
    return {n for n, _ in part.placement}


def _overlap(a: float, slow_a: float, b: float, slow_b: float) -> tuple[float, float]:
    """When two jobs of ``a`` and ``b`` seconds (each alone), slowed by ``slow_a`` and ``slow_b`` while both
    run, finish: the first to finish frees the cores, and the other finishes its work at full speed."""
    ta, tb = a * slow_a, b * slow_b
    if ta <= tb:
        return ta, ta + (b - ta / slow_b)
    return tb + (a - tb / slow_a), tb


class _Planner:
    def __init__(self, cfg: ExperimentConfig, plan, hw: HardwareProfile, prompt_tokens: float | None,
                 new_tokens: float | None, max_prompt_tokens: int | None = None):
        self.cfg, self.plan, self.hw = cfg, plan, hw
        self.f = ModelFacts.from_config(cfg.model)
        self.w = T.workload(cfg, prompt_tokens, new_tokens)
        self.max_prompt = int(max_prompt_tokens or cfg.dataset.max_prompt_len)
        self.cpu = hw.kind == "cpu" or cfg.cluster.device == "cpu"
        self.cores = T.host_cores(hw)
        self.actor = plan.train
        self.inf = plan.inference
        self.warnings: list[str] = []

    # ------------------------------------------------------------------ pieces
    def server(self):
        """(GenTime, memory) of one rollout server instance; None without one (SFT, RM)."""
        inf, cfg, w = self.inf, self.cfg, self.w
        from areal_cli.config.algo import generates

        if inf is None or not generates(cfg.algo.name):
            return None, None
        seq = int(w.prompt_tokens + w.decode_iters)
        admitted = min(cfg.rollout.max_concurrent_rollouts, (w.staleness + 1) * w.prompts) * w.group
        want = max(1, -(-admitted // inf.dp))
        mem = server_memory(cfg, inf, self.f, want, seq, self.hw.server_base,
                            max_seq_tokens=self.max_prompt + w.decode_iters,
                            push_mode=self.push_mode(),
                            # a weight version's prefix-cache stores: every prompt at prefill, every row at its end
                            cached_tokens=(w.samples * w.seq_tokens + w.prompts * w.prompt_tokens) / inf.dp)
        gen = T.generation_time(self.f, self.hw, w, inf.backend, inf.dp, inf.tp, inf.pp,
                                cfg.rollout.max_concurrent_rollouts, mem.concurrency or 1, cfg.cluster.device)
        return gen, mem

    def judge_time(self) -> float:
        """``workflow.reward=judge`` on the rollout servers: one chat call per sample (its question and
        answer in a ~64-token template, ``judge.max_new_tokens`` back, ``judge.max_concurrent`` at once),
        served by the same instances as generation, so its time adds to theirs. A judge at a URL runs on
        hardware this plan does not know: 0, and a warning says so."""
        cfg, w, inf = self.cfg, self.w, self.inf
        if str(cfg.workflow.reward) != "judge" or inf is None:
            return 0.0
        j = cfg.workflow.judge
        if j.server != "rollout":
            self.warnings.append("workflow.judge.server=url: the judge's time (a server this plan does not "
                                 "know) is not in the step")
            return 0.0
        calls = T.Workload(w.samples, 1, w.prompt_tokens + w.new_tokens + 64, float(j.max_new_tokens),
                           int(j.max_new_tokens), 0)
        t = T.generation_time(self.f, self.hw, calls, inf.backend, inf.dp, inf.tp, inf.pp, j.max_concurrent,
                              None, cfg.cluster.device)
        return t.total_s

    def trainer(self, threads: int):
        inter = len(_nodes(self.actor)) > 1
        return T.train_time(self.cfg, self.actor, self.f, self.hw, self.w, threads, inter)

    def push_mode(self) -> str:
        cfg, plan = self.cfg, self.plan
        backends = [p.backend for p in plan.inferences]
        return resolved_weight_update(cfg.rollout.weight_update, backends, self.f.lora_rank > 0,
                                      shared_gpu=plan.colocated and cfg.cluster.device == "cuda")

    def sync(self):
        cfg, plan = self.cfg, self.plan
        mode = self.push_mode()
        cross = bool(self.inf is not None and _nodes(self.inf) - {self.actor.placement[0][0]})
        return T.sync_time(cfg, plan, self.f, self.hw, mode, cross)

    def ranks_per_node(self) -> int:
        return max(1, -(-self.actor.n_devices // max(1, len(_nodes(self.actor)))))

    # ------------------------------------------------------------------ the step
    def steps(self, gen, reward_s, sync_s):
        """(sync step, async step, train time in the chosen mode, gen time, trainer threads) on this host."""
        gen_s = gen.total_s if gen is not None else 0.0
        colocated = self.plan.colocated
        if not self.cpu:
            train = self.trainer(1)
            sync_step = gen_s + reward_s + train.total_s + sync_s
            async_step = sync_step if colocated else max(gen_s + reward_s, train.total_s) + sync_s
            return sync_step, async_step, train, train, gen_s
        # CPU host: servers run one thread each; a sync step's trainer takes its share of the cores.
        ranks = self.ranks_per_node()
        servers = sum(p.dp * p.tp * p.pp for p in self.plan.inferences)
        share = max(1, self.cores // ranks)
        gen_cpu = gen_s * max(1.0, servers / self.cores)
        train_sync = self.trainer(share)
        sync_step = gen_cpu + reward_s + train_sync.total_s + sync_s
        if colocated:
            return sync_step, sync_step, train_sync, train_sync, gen_cpu
        # Async (StepThreads): one thread while generation is the bottleneck, all of the share otherwise.
        # The episodes' client side (the rollout worker) runs beside the generating servers on the same cores,
        # busy for this fraction of the generation.
        client = min(1.0, self.w.samples * self.w.new_tokens * T.CLIENT_CPU_S_PER_TOKEN / max(gen_s, 1e-9))
        # While both run, the scheduler gives every runnable thread the same share of the cores: a server
        # thread runs that much slower, a trainer rank's threads get that share each (its second thread
        # gains little, so losing it costs little).
        best = None
        for threads in sorted({1, share}):
            train = self.trainer(threads)
            each = min(1.0, self.cores / (servers + client + ranks * threads))
            slow_train = T.core_speed(threads) / T.core_speed(threads * each)
            gen_end, train_end = _overlap(gen_s + reward_s, 1 / each, train.total_s, slow_train)
            wall = max(gen_end, train_end) + sync_s
            if best is None or wall < best[0]:
                best = (wall, replace(train, shared_s=train_end - train.total_s))
        return sync_step, best[0], train_sync, best[1], gen_cpu

    def run(self) -> RunPlan:
        cfg, hw, w = self.cfg, self.hw, self.w
        gen, smem = self.server()
        reward_s = (T.reward_time(cfg, w) + self.judge_time()) if gen is not None else 0.0
        sync = self.sync() if gen is not None else None
        sync_s = sync.total_s if sync is not None else 0.0
        sync_step, async_step, train_sync, train_async, gen_s = self.steps(gen, reward_s, sync_s)
        is_async = w.staleness > 0 and not self.plan.colocated and gen is not None
        mode = "async" if is_async else "sync"
        if w.staleness == 0 and gen is not None and not self.plan.colocated:
            # What k=1 would give: the same work, overlapped.
            w1 = T.Workload(w.prompts, w.group, w.prompt_tokens, w.new_tokens, w.decode_iters, 1)
            other = self._with_workload(w1)
            async_step = other.steps(other.server()[0], reward_s, sync_s)[1]
        step_s = async_step if is_async else sync_step
        train = train_async if is_async else train_sync
        train_s = train.total_s
        gen_wait = max(0.0, step_s - train_s - sync_s)
        steps = StepTimes(mode, step_s, gen_s, gen.prefill_s if gen else 0.0, gen.decode_s if gen else 0.0,
                          reward_s, train_s, sync_s, sync_step, async_step, gen_wait)
        comps = self.components(gen, smem, steps)
        rp = RunPlan(self.plan.spec, hw, steps, w.samples / step_s, w.samples * w.new_tokens / step_s,
                     w.samples * w.seq_tokens / step_s, comps, "", self.warnings,
                     {"prompts": w.prompts, "group_size": w.group, "samples": w.samples,
                      "prompt_tokens": w.prompt_tokens, "new_tokens": w.new_tokens,
                      "decode_iters": w.decode_iters, "staleness": w.staleness},
                     {"generation": None if gen is None else {**asdict(gen), "total_s": gen.total_s},
                      "train": {**asdict(train), "total_s": train_s, "parts": train.parts()},
                      "weight_sync": None if sync is None else {**asdict(sync), "total_s": sync.total_s}})
        rp.bottleneck = self.bottleneck(rp, gen, train)
        for c in comps:
            if not c.memory.fits:
                self.warnings.append(f"{c.kind} '{c.name}': {c.memory.binds}")
        return rp

    def _with_workload(self, w: T.Workload) -> _Planner:
        other = _Planner.__new__(_Planner)
        other.__dict__.update(self.__dict__)
        other.w = w
        return other

    def components(self, gen, smem, steps: StepTimes) -> list[ComponentPlan]:
        out = []
        for p in self.plan.inferences:
            rollout = p is self.inf
            if rollout and smem is not None:
                mem = smem
            else:
                mem = server_memory(self.cfg, p, self.f, 1, int(self.w.seq_tokens), self.hw.server_base)
            busy = steps.gen_s + steps.reward_s if rollout and gen is not None else 0.0
            util = min(1.0, busy / steps.step_s) if steps.step_s > 0 else 0.0
            out.append(ComponentPlan(p.name, "inference", p.backend, f"d{p.dp}t{p.tp}p{p.pp}", p.n_devices,
                                     util, mem, busy))
        for t in self.plan.trains:
            par = t.parallel
            # A rank's tokens per minibatch at the mean lengths: packing fills micro-batches up to the budget,
            # so the fullest one (the peak) holds the budget or, when one is enough, all of them.
            mean_rank = self.w.samples * self.w.seq_tokens / (par.dp * self.cfg.algo.ppo_n_minibatches)
            mean_mb = min(float(t.micro_batch.tokens_per_mb), mean_rank)
            mem = trainer_memory(self.cfg, t, self.f, self.hw.process_base_gb, mean_mb_tokens=mean_mb)
            busy = steps.train_s + steps.sync_s if t is self.actor else 0.0
            util = min(1.0, busy / steps.step_s) if steps.step_s > 0 else 0.0
            out.append(ComponentPlan(t.name, "train", t.backend, f"d{par.dp}t{par.tp}p{par.pp}c{par.cp}",
                                     t.n_devices, util, mem, busy))
        return out

    def bottleneck(self, rp: RunPlan, gen, train) -> str:
        s = rp.step
        parts = train.parts()
        tpart = max(parts, key=lambda k: parts[k])
        tshare = parts[tpart] / max(train.total_s, 1e-12)
        t_name = self.actor.name
        if gen is None:
            return f"training on '{t_name}' is bound by {tpart} ({tshare:.0%} of the train time)"
        i_name = self.inf.name
        gen_what = ("prefill" if gen.prefill_s > gen.decode_s else f"decode ({gen.bound})")
        util = {c.kind: c.utilisation for c in rp.components if c.busy_s > 0}
        if s.mode == "async":
            if s.gen_s + s.reward_s >= s.train_s:
                return (f"generation on '{i_name}' is the bottleneck, bound by {gen_what}: the trainer idles "
                        f"{1 - util.get('train', 0):.0%} of each step")
            return (f"training on '{t_name}' is the bottleneck, bound by {tpart} ({tshare:.0%} of it): the "
                    f"servers idle {1 - util.get('inference', 0):.0%} of each step")
        phases = {"generation": s.gen_s, "training": s.train_s, "weight sync": s.sync_s, "rewards": s.reward_s}
        big = max(phases, key=lambda k: phases[k])
        why = {"generation": gen_what, "training": tpart, "weight sync": "the link between trainer and servers",
               "rewards": f"the {self.cfg.workflow.reward} reward"}[big]
        lead = "colocated components take turns" if self.plan.colocated else "synchronous steps run one phase at a time"
        return f"{lead}: {big} takes {phases[big] / s.step_s:.0%} of the step, bound by {why}"


def plan_config(cfg: ExperimentConfig, plan, profile: HardwareProfile, *, prompt_tokens: float | None = None,
                new_tokens: float | None = None, max_prompt_tokens: int | None = None) -> RunPlan:
    """The cost model of ``cfg`` as validated into ``plan`` (``plan.validate.validate(cfg)``) on ``profile``.
    ``prompt_tokens``/``new_tokens``: mean lengths when known (default: half of ``dataset.max_prompt_len``
    and all of ``rollout.gconfig.max_new_tokens``); ``max_prompt_tokens``: the longest prompt (default: the
    cap). ``planner.lengths.dataset_prompt_lengths`` reads both from the run's dataset."""
    return _Planner(cfg, plan, profile, prompt_tokens, new_tokens, max_prompt_tokens).run()
