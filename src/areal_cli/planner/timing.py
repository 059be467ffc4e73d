"""The time terms of one RL step: generation (prefill, decode, requests), rewards, training and weight sync.

Each function returns seconds with the parts that make them up, so the plan can say what binds. The terms
follow what the trainer loop measures (``trainer/rl.py:train_step``): ``perf/gen_wait_s`` is the wait for
the step's batch, ``perf/train_s`` everything ``_ppo_step`` does (logp recompute, reference and critic
forwards, the PPO minibatch updates), ``perf/weight_sync_s`` the push of the new weights to every server.

Rates come from a :class:`~areal_cli.allocation.hardware.HardwareProfile`. On a GPU every device runs its own
work. On a CPU host (``shared_compute``) the profile's rates are the whole host's over ``cores``: a server
runs one intra-op thread (the local launcher's ``OMP_NUM_THREADS=1``), a trainer rank its share of the
cores in a sync step and one thread in an async step that waits for generation (``StepThreads``), and
processes that want more cores than the host has slow each other down.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_cli.allocation.estimate import ModelFacts, dtype_bytes
from areal_cli.plan.distill import teacher_size_ratio
from areal_cli.plan.reward_model import rm_size_ratio
from areal_cli.allocation.hardware import HardwareProfile

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

# Per-sample reward cost, seconds: the sandboxed code reward runs a subprocess per sample (in a worker
# pool); math-verify parses both answers. Built-in numeric/exact rewards are string compares.
REWARD_S = {"code": 0.1, "math": 0.002}
REWARD_WORKERS = 8  # the reward pool's concurrency (rewards/runner)
# Speed-up of a CPU matmul per extra intra-op thread, measured on the 11.9M model (docs/train.md,
# "Threads of the train step": 2 threads 1.2x one): small models scale poorly across cores.
CPU_THREAD_GAIN = 0.2
# CPU hosts: the rollout client (the trainer's rollout worker process: HTTP, detokenization, rewards, episode
# assembly) burns CPU per generated token beside the server. benchmarks/plan_accuracy.py's per-process CPU
# accounting on a quiet 2-core box: worker CPU seconds = 8.6 s (start-up) + 46 µs per generated token, over
# group sizes 4 and 16 (20 steps each); the 11.9M runs at 16 and 64 tokens fall within 15% of that line.
CLIENT_CPU_S_PER_TOKEN = 46e-6
# Share of a data-parallel gradient reduction that overlaps the backward pass on GPUs (bucketed
# all-reduce / reduce-scatter); gloo on CPU runs it after the backward, exposed.
DP_OVERLAP = 0.7
# Decode reads the attention context of every running row; its average length is prompt + half the output.
_CTX_FRACTION = 0.5


@dataclass
class Workload:
    """What one step generates and trains on. Lengths default to the config's caps (prompts half-full,
    every completion running to ``max_new_tokens``); a benchmark that knows the real lengths passes them."""

    prompts: int  # algo.batch_size
    group: int  # rollout.group_size
    prompt_tokens: float  # mean tokens per prompt
    new_tokens: float  # mean generated tokens per sample
    decode_iters: int  # decode iterations a batch takes: its longest completion
    staleness: int  # rollout.max_head_offpolicyness

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    @property
    def seq_tokens(self) -> float:
        return self.prompt_tokens + self.new_tokens


def workload(cfg: ExperimentConfig, prompt_tokens: float | None = None,
             new_tokens: float | None = None) -> Workload:
    g = cfg.rollout.gconfig
    from areal_cli.config.algo import samples_per_prompt

    algo_g = samples_per_prompt(cfg.algo.name, cfg.rollout.group_size)
    return Workload(cfg.algo.batch_size, algo_g,
                    float(prompt_tokens if prompt_tokens is not None else max(1, cfg.dataset.max_prompt_len // 2)),
                    float(new_tokens if new_tokens is not None else g.max_new_tokens),
                    int(g.max_new_tokens), int(cfg.rollout.max_head_offpolicyness))


def host_cores(hw: HardwareProfile) -> int:
    return hw.cores or os.cpu_count() or 1


def thread_speedup(threads: int) -> float:
    return 1.0 + CPU_THREAD_GAIN * (max(1, threads) - 1)


def core_speed(cores: float) -> float:
    """Speed of a job given ``cores`` of CPU time at once, against one whole core: a share of one core runs
    it proportionally slower, extra cores gain ``CPU_THREAD_GAIN`` each (as :func:`thread_speedup`)."""
    return cores if cores <= 1 else thread_speedup(1) + CPU_THREAD_GAIN * (cores - 1)


def flops_rate(hw: HardwareProfile, threads: int = 1) -> float:
    """FLOP/s of one process at peak: a GPU's, or ``threads`` cores' share of a CPU host's."""
    if hw.kind == "cpu":
        return hw.matmul_tflops * 1e12 / host_cores(hw) * thread_speedup(threads)
    return hw.matmul_tflops * 1e12


def mem_rate(hw: HardwareProfile) -> float:
    """Bytes/s one process can stream: a GPU's HBM; on a small CPU host one thread gets most of the bandwidth."""
    return hw.mem_bw_gbs * 1e9


# ---------------------------------------------------------------------------------------------- generation
@dataclass
class GenTime:
    prefill_s: float
    decode_s: float
    request_s: float
    iter_s: float  # one decode iteration at the running batch
    concurrency: int  # sequences decoded together per instance
    bound: str  # "HBM bandwidth" | "compute" | "per-iteration overhead"

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.request_s


def decode_costs(f: ModelFacts, hw: HardwareProfile, tp: int, batch: int, ctx: float,
                 pb: int) -> tuple[dict[str, float], dict[str, float]]:
    """``(floor, row)``: the parts of one decode iteration on one t×p instance: an iteration of ``b`` running
    rows costs ``floor_s + b·row_s``. The floor is what every iteration pays whatever its batch: reading the
    weights once (the experts the batch routes to, for MoE), the fixed per-iteration cost (launches,
    scheduling, sampling) and, under t > 1, two latency-bound all-reduces per layer. Each row adds the larger
    of reading its KV cache (``ctx`` tokens) and its 2·N FLOPs. The stages of a pipeline run one after
    another, so p divides memory but not time."""
    experts_read = 1.0 if f.experts <= 0 else min(1.0, batch * max(1, f.experts_per_tok) / f.experts)
    bw = mem_rate(hw) * hw.decode_bw_eff
    # a decode step reads the language model only: the vision tower ran once, at prefill
    w_s = (f.dense_params() - f.vision + f.expert_params() * experts_read) * pb / tp / bw
    comm_s = 2 * f.layers * hw.collective_s if tp > 1 else 0.0
    kv_s = ctx * f.kv_bytes_per_token(pb, tp, 1) / bw
    comp_s = 2.0 * f.active_params() / tp / (flops_rate(hw) * hw.prefill_mfu)
    mem = "HBM bandwidth" if hw.kind == "gpu" else "memory bandwidth"
    floor = {f"{mem} (weights)": w_s, "per-iteration overhead": hw.decode_iter_s + comm_s}
    # A calibrated per-row cost is the measured slope of iteration time in the batch: it already holds the
    # row's FLOPs and KV reads on the host it was measured on, so it bounds them rather than adding to them.
    row = {f"{mem} (KV cache)": max(kv_s, hw.decode_row_s), "compute": max(comp_s, hw.decode_row_s)}
    return floor, row


def _decode(floor: dict[str, float], row: dict[str, float], n_iters: float, tokens: float) -> tuple[float, str]:
    """Seconds of ``n_iters`` iterations producing ``tokens`` tokens, and the part that costs the most."""
    row_key = max(row, key=lambda k: row[k])
    parts = {**{k: n_iters * v for k, v in floor.items()}, row_key: tokens * row[row_key]}
    return sum(parts.values()), max(parts, key=lambda k: parts[k])


def generation_time(f: ModelFacts, hw: HardwareProfile, w: Workload, backend: str, dp: int, tp: int,
                    pp: int, max_concurrent: int, kv_concurrency: int | None, device: str) -> GenTime:
    """Busy time of one server instance to produce its share (1/dp) of a step's samples.

    Concurrency per instance: the episodes the staleness bound admits (``(k+1)·B`` prompts, capped by
    ``rollout.max_concurrent_rollouts``) times the group size, split over the dp instances, capped by the
    KV cache. Every generated token costs its row's share (``row_s``) once, whenever it runs; the
    per-iteration floor is paid once per iteration. A synchronous step decodes its samples in waves, each
    running to its longest completion (``decode_iters``: the cap), so the floor is paid ``decode_iters`` times
    per wave even as the batch thins out (the long tail); an async run keeps the batch full, paying the floor
    once per ``conc`` tokens."""
    pb = 2 if device == "cuda" else 4
    share = w.samples / dp
    admitted = min(max_concurrent, (w.staleness + 1) * w.prompts) * w.group
    conc = max(1, min(math.ceil(admitted / dp), math.ceil(share * (w.staleness + 1))))
    if kv_concurrency is not None:
        conc = max(1, min(conc, kv_concurrency))
    running = min(conc, math.ceil(share))
    ctx = w.prompt_tokens + _CTX_FRACTION * w.new_tokens
    tokens = share * w.new_tokens
    batch = running if w.staleness == 0 else conc
    floor, row = decode_costs(f, hw, tp, batch, ctx, pb)
    n_iters = math.ceil(share / running) * w.decode_iters if w.staleness == 0 else tokens / conc
    decode_s, bound = _decode(floor, row, n_iters, tokens)
    iter_s = sum(floor.values()) + batch * max(row.values())
    # A group's samples share their prompt: SGLang's radix cache and the hf server prefill it once.
    prefill_tokens = share / w.group * w.prompt_tokens
    prefill_s = 2.0 * f.active_params() * prefill_tokens / tp / (flops_rate(hw) * hw.prefill_mfu)
    # Requests run concurrently: their round trip is latency paid once per wave of concurrent requests (one
    # per group where the backend takes batches, hf and SGLang: its spec's batch_generate; one per sample otherwise).
    from areal_cli.inference.backends import backend_spec

    batched = backend_spec(backend).batch_generate
    requests = share / w.group if batched else share
    waves = math.ceil(requests / max(1, conc / (w.group if batched else 1)))
    return GenTime(prefill_s, decode_s, waves * hw.request_s, iter_s, int(conc), bound)


def reward_time(cfg: ExperimentConfig, w: Workload) -> float:
    per = REWARD_S.get(str(cfg.workflow.reward), 0.0)
    return w.samples * per / REWARD_WORKERS


# ---------------------------------------------------------------------------------------------- training
@dataclass
class TrainTime:
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    cp_comm_s: float
    dp_comm_s: float  # exposed part
    overhead_s: float  # per micro-batch and per optimizer step
    optim_s: float  # the memory-bound optimizer update
    flops: float
    n_micro_batches: int
    shared_s: float = 0.0  # a CPU host: the slowdown from sharing the cores with the servers' generation

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_comm_s + self.cp_comm_s + self.dp_comm_s
                + self.overhead_s + self.optim_s + self.shared_s)

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute_s, "pipeline bubbles": self.bubble_s,
                "tensor-parallel communication": self.tp_comm_s, "context-parallel communication": self.cp_comm_s,
                "gradient reduction": self.dp_comm_s, "per-micro-batch overhead": self.overhead_s,
                "optimizer update": self.optim_s, "cores shared with generation": self.shared_s}


def train_passes(cfg: ExperimentConfig) -> tuple[float, float]:
    """(forward-backward passes, forward-only passes) over the step's tokens, in units of the policy model:
    the PPO update (8N with full recompute instead of 6N: the forward runs twice), a logp recompute
    (decoupled loss or ``recompute_logprob``), the KL reference's forward, a distillation teacher's forward (its
    size over the policy's), a reward model's forward (likewise), a critic's forward and update."""
    a = cfg.algo
    from areal_cli.engines import get_engine_spec

    full = get_engine_spec(cfg.engine.name).full_recompute  # megatron's "selective" recomputes attention only
    recompute = cfg.engine.gradient_checkpointing and (full is None or full(cfg.engine))
    fb = 4.0 / 3.0 if recompute else 1.0
    fwd = 0.0
    if (a.use_decoupled_loss and a.prox_logp_method == "recompute") or a.recompute_logprob:
        fwd += 1
    if a.kl_coef > 0:
        fwd += 1
    fwd += teacher_size_ratio(cfg)
    fwd += rm_size_ratio(cfg)  # the reward model's forward over the step's rows
    if a.use_critic:
        fb, fwd = fb * 2, fwd + 1
    return fb, fwd


def step_flops(f: ModelFacts, tokens: float, loss_tokens: float, seq_tokens: float, fb: float,
               fwd: float) -> float:
    """FLOPs of ``fb`` forward-backward and ``fwd`` forward-only passes over ``tokens`` trained positions.

    2 FLOPs per parameter per token forward (4 backward) through the layers, plus causal attention's score
    and value matmuls, 4·layers·(seq/2)·(heads·head_dim) per token forward, counted as the parameters that
    would cost the same. The vocabulary projection (vocab × hidden) runs in the training pass on the
    ``loss_tokens`` only (the engines project the positions that carry loss, as TRL's
    ``logits_to_keep``), and in a forward-only logp pass on every position; the embedding lookup is free.
    With a small model that head is much of the parameters, so counting it on every token (6·N) would be
    off by up to 2×."""
    head = f.vocab * f.hidden
    body = max(0, f.active_params() - head * (1 if f.tied else 2))
    attn = f.layers * seq_tokens * f.heads * f.head_dim
    return 6 * fb * ((body + attn) * tokens + head * loss_tokens) + 2 * fwd * (body + attn + head) * tokens


def train_time(cfg: ExperimentConfig, part, f: ModelFacts, hw: HardwareProfile, w: Workload, threads: int,
               inter_node: bool) -> TrainTime:
    """Seconds of ``perf/train_s`` on the trainer ``part`` (a validated TrainPart).

    ≈ 6·N·tokens / (peak × train_mfu × world) for the PPO update (2·N·tokens per forward-only pass;
    :func:`step_flops`), over
    ``threads`` cores per rank on a CPU; pipeline bubbles (p−1)/(m+p−1); per micro-batch the tensor- and
    context-parallel collectives of every layer; per minibatch the gradient reduction over d×c (FSDP also
    gathers each layer's weights per micro-batch) on the intra- or inter-node link; a fixed cost per
    micro-batch and optimizer step, and the optimizer's memory-bound update (16 bytes per local parameter).
    """
    par = part.parallel
    world = par.dp * par.tp * par.pp * par.cp
    mb = part.micro_batch
    fb, fwd = train_passes(cfg)
    shared = cfg.engine.shared_prefix and w.group > 1
    tokens = (w.prompts * w.prompt_tokens if shared else w.samples * w.prompt_tokens) + w.samples * w.new_tokens
    flops = step_flops(f, tokens, w.samples * w.new_tokens, w.seq_tokens, fb, fwd)
    # Per minibatch per data-parallel rank. Packing fills each micro-batch's token budget with the real
    # sequences, so with the mean lengths the count is the rank's tokens over the budget; validation's
    # count assumes every sequence at its cap, the most it can be.
    rank_mb_tokens = tokens / (par.dp * cfg.algo.ppo_n_minibatches)
    packed = math.ceil(rank_mb_tokens / max(1, mb.tokens_per_mb))
    n_mb = max(1, min(mb.n_micro_batches, packed))
    # A calibrated CPU host's rate depends on the micro-batch's working set (caches); the ranks of one node
    # run at once and share those caches, so their micro-batches count together.
    per_node = max(1, world // max(1, len({n for n, _ in part.placement})))
    rate = flops_rate(hw, threads) * hw.train_mfu_at(f.hidden, rank_mb_tokens / n_mb * per_node)
    compute = flops / (world * rate)
    if par.tp > 1:
        compute /= hw.tp_token_eff
    bubble = compute * (par.pp - 1) / n_mb if par.pp > 1 else 0.0
    pb = dtype_bytes(cfg.engine.dtype)
    link = (hw.inter_node_gbs if inter_node else hw.intra_node_gbs) * 1e9 * hw.comm_eff
    intra = hw.intra_node_gbs * 1e9 * hw.comm_eff
    rank_tokens = tokens / (par.dp * par.cp)
    layers_stage = math.ceil(f.layers / par.pp)
    passes = 3 * fb + fwd  # collectives run forward (1) and backward (2) per fb pass, forward per fwd pass
    total_mbs = n_mb * cfg.algo.ppo_n_minibatches
    tp_comm = cp_comm = 0.0
    if par.tp > 1:
        per_layer = 2 * rank_tokens * f.hidden * pb * 2 * (par.tp - 1) / par.tp / intra
        # per micro-batch and layer: two collectives' latency, or what a calibrated host measured in all
        tp_comm = passes * layers_stage * (per_layer + total_mbs * max(2 * hw.collective_s, hw.tp_layer_s))
    if par.cp > 1:
        kv = 2 * f.kv_heads * f.head_dim
        cp_comm = passes * layers_stage * (rank_tokens * kv * pb * (par.cp - 1) / intra
                                           + total_mbs * hw.collective_s)
    local = f.total_params() / (par.tp * par.pp)
    trainable = f.lora_params() / (par.tp * par.pp) if f.lora_rank > 0 else local
    models = 2 if cfg.algo.use_critic else 1
    shard = par.dp * par.cp
    dp_comm = 0.0
    if shard > 1:
        grad_b = 4 if cfg.engine.dtype == "float32" else 2
        from areal_cli.engines import get_engine_spec

        # the engines that gather each layer's weights (fsdp, archon, ZeRO-3), as their spec's sharding says
        gathers = get_engine_spec(part.backend).sharding(cfg.engine).gathers_layers
        if gathers and cfg.engine.grad_reduce == "per_micro_batch":
            # FSDP2 reduce-scatters after every micro-batch, and gathers each layer's weights for the
            # forward and again for the backward.
            dp_comm = total_mbs * trainable * grad_b * (shard - 1) / shard / link
        else:  # one all-reduce (or reduce-scatter + all-gather) per optimizer step
            dp_comm = cfg.algo.ppo_n_minibatches * trainable * grad_b * 2 * (shard - 1) / shard / link
        if gathers:
            dp_comm += total_mbs * (2 * fb / models + fwd) * local * pb * (shard - 1) / shard / link
        dp_comm *= models
        if hw.kind == "gpu":
            dp_comm = max(dp_comm - DP_OVERLAP * compute, (1 - DP_OVERLAP) * dp_comm)
    overhead = hw.train_mb_s * total_mbs * (fb + 0.5 * fwd) + hw.optim_step_s * cfg.algo.ppo_n_minibatches
    optim = cfg.algo.ppo_n_minibatches * trainable * 16 / mem_rate(hw) * models
    return TrainTime(compute, bubble, tp_comm, cp_comm, dp_comm, overhead, optim, flops, int(total_mbs))


# ---------------------------------------------------------------------------------------------- weight sync
@dataclass
class SyncTime:
    mode: str  # "distributed" | "disk"
    bytes: float
    gather_s: float  # collecting t/p shards on the sending rank
    transfer_s: float
    reload_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.gather_s + self.transfer_s + self.reload_s + self.overhead_s


def sync_time(cfg: ExperimentConfig, plan, f: ModelFacts, hw: HardwareProfile, mode: str,
              cross_node: bool) -> SyncTime:
    """``perf/weight_sync_s``: the model's bytes from the trainer to every server, then loaded there.

    distributed: one broadcast from trainer rank 0 (a pipelined broadcast costs ~bytes/bandwidth whatever
    the number of receivers) over the link between trainer and servers, after gathering the t×p shards;
    disk: the trainer writes a checkpoint and each server reads it back. Every tensor is one collective
    (latency) and every server takes a few control requests (pause, update, continue)."""
    from areal_cli.planner.memory import weight_bytes

    nbytes = weight_bytes(f, cfg.rollout.weight_update_dtype)
    train = plan.train.parallel
    shards = train.tp * train.pp
    intra = hw.intra_node_gbs * 1e9 * hw.comm_eff
    gather = nbytes * (shards - 1) / shards / intra if shards > 1 else 0.0
    n_tensors = f.layers * (12 if f.experts <= 0 else 12 + 3 * f.experts) + 3
    n_servers = sum(p.dp for p in plan.inferences) or 1
    if mode == "disk":
        disk = hw.disk_gbs * 1e9
        transfer = 2 * nbytes / disk  # write, then read back (servers read in parallel)
    else:
        link = (hw.inter_node_gbs if cross_node else hw.intra_node_gbs) * 1e9 * hw.comm_eff
        transfer = nbytes / link + n_tensors * hw.collective_s
    # Each server copies the new weights into place: bounded by its memory bandwidth (read + write).
    inst = plan.inference
    per_dev = nbytes / max(1, inst.tp * inst.pp) if inst is not None else nbytes
    reload = 2 * per_dev / mem_rate(hw)
    overhead = 4 * n_servers * hw.request_s + n_tensors * hw.collective_s
    return SyncTime(mode, nbytes, gather, transfer, reload, overhead)
