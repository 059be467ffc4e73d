"""Cross-group validation: turn an ExperimentConfig into a :class:`Plan` or a ConfigError.

Needs no GPU, no weights and no torch. Every rule names the dotted config path, the reason and
the fix; rules about the allocation spec point a caret at the offending dimension.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from areal_cli.allocation import autosize
from areal_cli.allocation.estimate import (
    ModelFacts,
    TrainMemory,
    companion_states,
    device_memory_gb,
    inference_memory,
    train_memory,
)
from areal_cli.allocation.parser import SPEC_PATH, backend_dims, did_you_mean, parse_allocation
from areal_cli.allocation.placement import place
from areal_cli.allocation.plan import InferencePart, MicroBatch, Plan, TrainPart
from areal_cli.allocation.spec import DIM_NAMES, AllocationSpec, Component, Dims, train_backends
from areal_cli.api.io_struct import ParallelStrategy
from areal_cli.config.algo import generates, samples_per_prompt
from areal_cli.algorithms.config_checks import validate_algo_config, validate_group_size
from areal_cli.config.launcher import local_multi_node
from areal_cli.config.model import VISION_FAMILIES, is_vision_language
from areal_cli.plan.lora_rules import check_lora
from areal_cli.plan.vision_rules import check_vision, check_visual_servers
from areal_cli.plan.packages import check_packages
from areal_cli.config.ranges import check_ranges
from areal_cli.config.cluster import DEVICES
from areal_cli.config.engine import DTYPES, GRAD_REDUCE_MODES, RECOMPUTE_GRANULARITIES, TIED_HEAD_MODES
from areal_cli.config.rollout import ROUTINGS, WEIGHT_UPDATES, keep_sampling_mask_active
from areal_cli.config.workflow import RM_COMBINES, RM_NORMALIZES
from areal_cli.plan.distill import check_distill, teacher_size_ratio
from areal_cli.plan.reward_model import check_reward_model, check_rm_placement, rm_note, rm_size_ratio
from areal_cli.plan.recipe import check_model_facts
from areal_cli.inference.push_mode import disk_only
from areal_cli.config.schema import ExperimentConfig
from areal_cli.data.checks import check_dataset
from areal_cli.engines import (ENGINE_SPECS, attn_impl, engine_dims, engines_with, get_engine_spec,
                               is_import_path)
from areal_cli.errors import ConfigError
from areal_cli.inference.backends import DEFAULT_BACKEND, backend_spec, imageless_backends
from areal_cli.allocation.hardware import gpu_memory_gb, resolve_hardware
from areal_cli.registry import load_plugins
from areal_cli.rewards.judge_prompt import check_judge_config
from areal_cli.rewards.registry import check_reward_name
from areal_cli.rollout.workflows import check_workflow_config

CHOICES = {
    "cluster.device": DEVICES,
    "engine.dtype": DTYPES,
    "engine.attn_impl": attn_impl.ATTN_IMPLS,
    "engine.grad_reduce": GRAD_REDUCE_MODES,
    "engine.tied_head": TIED_HEAD_MODES,
    "engine.megatron.recompute_granularity": RECOMPUTE_GRANULARITIES,
    "launcher.name": lambda: _launcher_names(),  # the registry's, plugins' included
    "rollout.weight_update": WEIGHT_UPDATES,
    "rollout.routing": ROUTINGS,
    "workflow.reward_model.combine": RM_COMBINES,
    "workflow.reward_model.normalize": RM_NORMALIZES,
}


def _launcher_names() -> tuple[str, ...]:
    from areal_cli.launchers.base import LAUNCHER_REGISTRY

    return LAUNCHER_REGISTRY.names()


def _get(cfg: ExperimentConfig, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _check_scalars(cfg: ExperimentConfig) -> None:
    if str(cfg.engine.dtype).lower() in ("float16", "fp16", "half"):
        from areal_cli.engines.precision import FP16_FIX, FP16_REASON

        raise ConfigError("engine.dtype", FP16_REASON, FP16_FIX)
    for path, choices in CHOICES.items():
        choices = choices() if callable(choices) else choices
        v = _get(cfg, path)
        if v not in choices:
            raise ConfigError(path, f"unknown value '{v}'",
                              f"{did_you_mean(str(v), choices)}choose one of: {', '.join(choices)}")
    # Names come from the registries (built-ins and plugins); an import path resolves at run time.
    check_workflow_config(cfg.workflow.name, cfg.workflow.kwargs, cfg.rollout.group_size)
    check_reward_name(cfg.workflow.reward)
    m = cfg.model
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError("model.num_key_value_heads",
                          f"{m.num_key_value_heads} does not divide num_attention_heads="
                          f"{m.num_attention_heads}", "grouped-query attention needs heads % kv_heads == 0")
    if m.head_dim == 0 and m.hidden_size % m.num_attention_heads:
        raise ConfigError("model.hidden_size", f"{m.hidden_size} is not divisible by num_attention_heads="
                          f"{m.num_attention_heads}", "set model.head_dim explicitly")
    if m.num_experts < 0 or (m.num_experts > 0 and not 0 < m.num_experts_per_tok <= m.num_experts):
        raise ConfigError("model.num_experts_per_tok", f"{m.num_experts_per_tok} is not in 1..num_experts="
                          f"{m.num_experts}", "set the MoE top-k from the model's config.json")
    if abs(cfg.algo.temperature - cfg.rollout.gconfig.temperature) > 1e-9:
        raise ConfigError("algo.temperature", f"{cfg.algo.temperature} differs from "
                          f"rollout.gconfig.temperature={cfg.rollout.gconfig.temperature}",
                          "set both to the same value: the trainer must recompute logprobs at the "
                          "sampling temperature")
    seq = cfg.dataset.max_prompt_len + cfg.rollout.gconfig.max_new_tokens
    if seq > m.max_position_embeddings:
        raise ConfigError("rollout.gconfig.max_new_tokens",
                          f"prompt + generation = {seq} tokens exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings}", "lower dataset.max_prompt_len or max_new_tokens")
    if cfg.engine.max_tokens_per_mb != autosize.AUTO and cfg.engine.max_tokens_per_mb < seq:
        raise ConfigError("engine.max_tokens_per_mb",
                          f"{cfg.engine.max_tokens_per_mb} is smaller than one sequence ({seq} tokens = "
                          "dataset.max_prompt_len + rollout.gconfig.max_new_tokens)",
                          f"set engine.max_tokens_per_mb={seq} or more")


def _check_engine_sections(cfg: ExperimentConfig) -> None:
    """The backend exists, and no other backend's own section was changed (it would be ignored)."""
    import dataclasses

    spec = get_engine_spec(cfg.engine.name)  # an unknown backend or import path fails here, by name
    if spec.check_config is not None:
        spec.check_config(cfg.engine)
    for other in ENGINE_SPECS.values():
        key = other.config_key
        if key is None or key == spec.config_key:
            continue
        section = getattr(cfg.engine, key)
        default = type(section)()
        for f in dataclasses.fields(section):
            if getattr(section, f.name) != getattr(default, f.name):
                raise ConfigError(f"engine.{key}.{f.name}", f"is set, but engine={cfg.engine.name} does not "
                                  f"read the {other.name} section", f"drop it, or train with engine={other.name}")


class _SpecChecker:
    def __init__(self, spec: AllocationSpec, cfg: ExperimentConfig):
        self.spec, self.cfg, self.m = spec, cfg, cfg.model

    def err(self, reason: str, hint: str, dims: Dims | None, letter: str | None,
            comp: Component) -> ConfigError:
        col = dims.span.get(letter, comp.column) if dims is not None and letter else comp.column
        return ConfigError(SPEC_PATH, reason, hint, text=self.spec.text, column=col)

    def divisors_hint(self, letter: str, *values: int) -> str:
        g = 0
        for v in values:
            g = math.gcd(g, v)
        ok = [k for k in range(1, g + 1) if g % k == 0]
        return f"use {letter} in {{{', '.join(map(str, ok))}}}"

    def check(self, c: Component) -> None:
        m, d = self.m, c.dims
        backend = c.backend or self.cfg.engine.name
        allowed = backend_dims(backend, c.kind)
        constraint = get_engine_spec(backend).constraint if c.kind == "train" else None
        why = constraint(d) if constraint is not None else None
        if why:
            reason, _, fix = why.partition("; ")
            raise self.err(f"engine {backend} cannot run {c.dims_text()}: {reason}", fix or "change the dims",
                           d, "c", c)
        for letter in "dtpce":
            if d.get(letter) > 1 and letter not in allowed:
                raise self.err(f"engine {backend} does not support {DIM_NAMES[letter]} parallelism "
                               f"({letter}{d.get(letter)})",
                               f"drop {letter}{d.get(letter)} or use an engine that supports it "
                               f"({', '.join(b for b in train_backends() if letter in engine_dims(b))})",
                               d, letter, c)
        heads, kv, layers = m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers
        who = f"model {m.name}"
        def t_ok(t: int) -> bool:
            # sglang/vllm replicate KV heads when t is a multiple of them; trainers shard them.
            return heads % t == 0 and (kv % t == 0 or (c.kind == "inference" and t % kv == 0))

        if not t_ok(d.t):
            good = [str(t) for t in range(1, heads + 1) if t_ok(t)]
            what = (f"model.num_attention_heads={heads}" if heads % d.t else
                    f"model.num_key_value_heads={kv}")
            raise self.err(f"t={d.t} does not divide {what} ({who})",
                           f"use t in {{{', '.join(good)}}}", d, "t", c)
        # Ulysses splits heads across the c ranks
        if d.c > 1 and (c.kind != "train" or get_engine_spec(backend).c_splits_heads):
            if heads % (d.t * d.c):
                raise self.err(f"Ulysses c={d.c} × t={d.t} does not divide model.num_attention_heads="
                               f"{heads} ({who})", self.divisors_hint("c", heads // math.gcd(heads, d.t)),
                               d, "c", c)
            if kv % (d.t * d.c) and (d.t * d.c) % kv:
                raise self.err(f"Ulysses c={d.c} × t={d.t} and model.num_key_value_heads={kv} "
                               f"must divide one another ({who})", "lower c", d, "c", c)
        spec = get_engine_spec(backend) if c.kind == "train" else None
        if spec is not None and spec.check_layers is not None:
            spec.check_layers(self.cfg.engine, d, layers)
        if not (spec is not None and spec.uneven_layers) and layers % d.p:
            raise self.err(f"p={d.p} does not divide model.num_hidden_layers={layers} ({who})",
                           self.divisors_hint("p", layers), d, "p", c)
        self.check_experts(c, d, c.ffn)

    def check_experts(self, c: Component, d: Dims, ffn: Dims | None) -> None:
        m = self.m
        e_dims = ffn if ffn is not None else d
        if ffn is not None:
            if m.num_experts <= 0:
                raise self.err(f"the hybrid MoE form needs an MoE model, but {m.name} is dense "
                               "(model.num_experts=0)",
                               f"use plain dims such as {c.backend or self.cfg.engine.name}:d2t2p2",
                               None, None, c)
            aw, fw = d.d * d.t * d.p * d.c, ffn.d * ffn.t * ffn.p * ffn.e
            if aw != fw:
                raise self.err(f"hybrid MoE parts use different device counts: attn {aw}, ffn {fw}",
                               "make d·t·p·c (attn) equal d·t·p·e (ffn)", ffn, "d", c)
            if d.p != ffn.p:
                raise self.err(f"hybrid MoE pipeline sizes differ: attn p={d.p}, ffn p={ffn.p}",
                               "use the same p in both parts", ffn, "p", c)
        if e_dims.e > 1:
            if m.num_experts <= 0:
                raise self.err(f"e={e_dims.e} needs an MoE model, but {m.name} is dense "
                               "(model.num_experts=0)", "drop e or pick an MoE model preset",
                               e_dims, "e", c)
            if m.num_experts % e_dims.e:
                raise self.err(f"e={e_dims.e} does not divide model.num_experts={m.num_experts}",
                               self.divisors_hint("e", m.num_experts), e_dims, "e", c)
            if c.kind == "train" and ffn is None and (d.d * d.c) % d.e:
                raise self.err(f"expert parallel e={d.e} must divide d×c={d.d * d.c} (experts are "
                               "sharded across data-parallel ranks)",
                               "lower e, raise d" + "".join(f", or use the hybrid form {n}:(attn:…|ffn:…)"
                                                          for n in engines_with("hybrid_moe")[:1]),
                               d, "e", c)


def _resolved_spec(cfg: ExperimentConfig) -> AllocationSpec:
    spec = parse_allocation(cfg.allocation_mode.spec)
    backend = spec.train_backend
    if backend is not None and backend != cfg.engine.name:
        raise ConfigError("engine", f"engine.name={cfg.engine.name} disagrees with allocation_mode.spec, "
                          f"which trains with {backend}",
                          f"set engine={backend} or drop '{backend}' from the spec")
    if not spec.train:
        raise ConfigError(SPEC_PATH, "the spec has no train component", f"add one, e.g. "
                          f"{spec.text}+{cfg.engine.name}:d1", text=spec.text, column=len(spec.text))
    if not spec.inference and generates(cfg.algo.name):
        raise ConfigError(SPEC_PATH, f"algo={cfg.algo.name} generates rollouts but the spec has no "
                          "inference component", "add one, e.g. hf:d1+fsdp:d1 (or use algo=sft or algo=rm)",
                          text=spec.text, column=0)
    return spec


def _check_reward_model(cfg: ExperimentConfig, spec: AllocationSpec) -> None:
    """``algo=rm`` trains the engine's critic (a value head) on preference pairs; ``workflow.reward_model`` runs
    one forward-only on the trainer's engine. Either needs an engine with a critic path."""
    if cfg.algo.name == "rm":
        path, why = "engine", "algo=rm trains a value head"
    elif cfg.workflow.reward_model.enabled and generates(cfg.algo.name):
        path, why = "workflow.reward_model.path", "the reward model runs as a critic on the trainer's engine"
    else:
        return
    for c in spec.train:
        backend = c.backend or cfg.engine.name
        has = _has_critic_path(backend) if is_import_path(backend) else get_engine_spec(backend).critic
        if not has:
            raise ConfigError(path, f"{why}, and the {backend} engine has no critic path",
                              f"use engine={' or engine='.join(engines_with('critic'))}")
    if cfg.algo.name != "rm":
        return
    if cfg.trainer.sft_warmup_steps > 0 and not cfg.dataset.train_path.startswith("builtin:"):
        raise ConfigError("trainer.sft_warmup_steps", f"{cfg.trainer.sft_warmup_steps} SFT steps before the reward "
                          "model need question/answer items, and algo=rm on local preference pairs has none",
                          "set trainer.sft_warmup_steps=0 (start from model.path, e.g. your SFT model)")
    if int(cfg.model.lora.rank) > 0:
        raise ConfigError("model.lora.rank", "algo=rm trains every weight of the reward model (no adapter)",
                          "set model.lora.rank=0")


def _has_critic_path(name: str) -> bool:
    """A plugin engine (``pkg.module:Class``) built on the shared engine base inherits its critic path
    (``critic=True``, ``forward(output="values")``). Read from the class's MRO: no torch import here."""
    from areal_cli.engines import _import_class, is_import_path

    if not is_import_path(name):
        return False
    return any(k.__name__ == "EngineBase" and k.__module__ == "areal_cli.engines.base"
               for k in _import_class(name).__mro__)


def _micro_batch(cfg: ExperimentConfig, dp: int, c: Component, auto: bool = False) -> MicroBatch:
    samples = cfg.algo.batch_size * samples_per_prompt(cfg.algo.name, cfg.rollout.group_size)
    if cfg.algo.batch_size % dp:
        good = dp * max(1, round(cfg.algo.batch_size / dp))
        raise ConfigError("algo.batch_size",
                          f"{cfg.algo.batch_size} prompts × rollout.group_size={cfg.rollout.group_size} "
                          f"= {samples} samples is not divisible by DP={dp} × group_size (train "
                          f"component '{c.label}' has d={dp}); groups must not be split across ranks",
                          f"set algo.batch_size to a multiple of {dp}, e.g. {good}")
    per_rank = samples // dp
    if per_rank % cfg.algo.ppo_n_minibatches:
        raise ConfigError("algo.ppo_n_minibatches",
                          f"{per_rank} samples per data-parallel rank cannot be split into "
                          f"{cfg.algo.ppo_n_minibatches} minibatches",
                          "use a divisor of the per-rank sample count")
    seq = cfg.dataset.max_prompt_len + cfg.rollout.gconfig.max_new_tokens
    tokens = per_rank // cfg.algo.ppo_n_minibatches * seq
    mb_tokens = min(cfg.engine.max_tokens_per_mb, tokens)
    seqs_per_mb = max(1, cfg.engine.max_tokens_per_mb // seq)
    n_mb = math.ceil(per_rank // cfg.algo.ppo_n_minibatches / seqs_per_mb)
    return MicroBatch(per_rank, seq, mb_tokens, n_mb, auto=auto)


def _train_memory_at(cfg: ExperimentConfig, facts: ModelFacts, c: Component, dev_gb: float,
                     seq: int) -> tuple[Callable[[int], float], int]:
    """``(k -> estimated GB per device with micro-batches of k sequences, sequences per minibatch per rank)``
    for train component ``c``; an indivisible batch is left to :func:`_micro_batch` to report."""
    par = c.parallel()
    ffn_tp = c.ffn.t if c.ffn is not None else par.tp
    sharding = get_engine_spec(c.backend or cfg.engine.name).sharding(cfg.engine)
    samples = cfg.algo.batch_size * samples_per_prompt(cfg.algo.name, cfg.rollout.group_size)
    per_mini = max(1, samples // par.dp // cfg.algo.ppo_n_minibatches)

    companions = _companions(cfg, facts)

    def total_gb(k: int) -> float:
        m = train_memory(facts, sharding, par, ffn_tp, cfg.engine.dtype, k * seq, math.ceil(per_mini / k),
                         cfg.engine.gradient_checkpointing, dev_gb)
        return m.total_gb + sum(companions(m))

    return total_gb, per_mini


def _companions(cfg: ExperimentConfig, facts: ModelFacts) -> Callable[[TrainMemory], tuple[float, float, float]]:
    """``actor memory -> (weights, grads, optimizer) GB`` of the engines beside the actor in its process."""
    kw = dict(reference=cfg.algo.kl_coef > 0 and facts.lora_rank == 0, critic=bool(cfg.algo.use_critic),
              teacher=teacher_size_ratio(cfg), reward_model=rm_size_ratio(cfg))
    return lambda m: companion_states(m, **kw)


def _resolve_auto(cfg: ExperimentConfig, spec: AllocationSpec, facts: ModelFacts, dev_gb: float,
                  seq: int) -> tuple[list[autosize.AutoChoice], ConfigError | None]:
    """Replace ``auto`` in engine.max_tokens_per_mb and rollout.max_concurrent_rollouts by numbers from the
    memory model (allocation/autosize.py), in ``cfg`` itself: the run's config.yaml, and so every trainer
    and engine, get the ints. A micro-batch of one sequence larger than the device comes back as the error to
    raise once the other rules have spoken (the plan is built with one sequence meanwhile)."""
    chosen: list[autosize.AutoChoice] = []
    error = None
    if cfg.engine.max_tokens_per_mb == autosize.AUTO:
        choice, error = _auto_micro_batch(cfg, spec, facts, dev_gb, seq)
        cfg.engine.max_tokens_per_mb = choice.value
        chosen.append(choice)
    if cfg.rollout.max_concurrent_rollouts == autosize.AUTO:
        choice = _auto_concurrency(cfg, spec, facts, dev_gb, seq)
        cfg.rollout.max_concurrent_rollouts = choice.value
        chosen.append(choice)
    return chosen, error


def _auto_micro_batch(cfg: ExperimentConfig, spec: AllocationSpec, facts: ModelFacts, dev_gb: float,
                      seq: int) -> tuple[autosize.AutoChoice, ConfigError | None]:
    """The budget every train component fits (the engine config is shared, so the smallest)."""
    budget = autosize.MEMORY_MARGIN * dev_gb
    best: tuple[int, str, str] | None = None
    error = None
    for c in spec.train:
        total_gb, per_mini = _train_memory_at(cfg, facts, c, dev_gb, seq)
        cap = autosize.micro_batch_cap(per_mini, c.dims.p)
        k = autosize.largest_fitting_seqs(total_gb, cap, budget)
        name = c.label if c.name else c.backend or cfg.engine.name
        if k == 0 and total_gb(1) > dev_gb and error is None:
            fix = "raise t, p or d of that component" + (
                "" if cfg.engine.gradient_checkpointing else ", set engine.gradient_checkpointing=true") + \
                ", shorten dataset.max_prompt_len or rollout.gconfig.max_new_tokens" + (
                ", or use larger GPUs (cluster.gpu_memory_gb)" if cfg.cluster.device == "cuda" else "")
            error = ConfigError("engine.max_tokens_per_mb",
                                f"auto: one sequence of {seq} tokens needs an estimated {total_gb(1):.1f} GB "
                                f"per device on train component '{name}', more than the device's "
                                f"{dev_gb:.1f} GB", fix)
        # Within the device but over the margin: one sequence, with a warning (validate) rather than an error.
        bound = "over margin" if k == 0 else "minibatch" if k == cap else "memory"
        k = max(1, k)
        if best is None or k < best[0] or bound == "over margin":
            detail = (f"{k} × {seq}-token sequences: est. {total_gb(k):.1f} GB per device on '{name}' of "
                      f"{autosize.MEMORY_MARGIN:.0%} × {dev_gb:.1f} GB = {budget:.1f} GB")
            if bound == "minibatch":
                detail += (f"; capped at a minibatch per rank ({per_mini} sequences"
                           + (f" / p={c.dims.p}" if c.dims.p > 1 else "") + ")")
            best = (k, bound, detail)
    k, bound, detail = best or (1, "memory", "")
    return autosize.AutoChoice("engine.max_tokens_per_mb", k * seq, bound, detail), error


def _auto_concurrency(cfg: ExperimentConfig, spec: AllocationSpec, facts: ModelFacts, dev_gb: float,
                      seq: int) -> autosize.AutoChoice:
    kv, backends = [], set()
    for c in spec.inference:
        d, backend = c.dims, c.backend or DEFAULT_BACKEND
        backends.add(backend)
        mem = inference_memory(facts, backend, d.t, d.p, d.e, cfg.cluster.device, dev_gb, 0, seq)
        kv.append((mem.kv_tokens, d.d))
    # An episode decodes its whole group at once (rollout/workflows/rlvr.py); the servers' prefix cache
    # holds the shared prompt once.
    episode = cfg.dataset.max_prompt_len + cfg.rollout.group_size * cfg.rollout.gconfig.max_new_tokens
    cap = (cfg.rollout.max_head_offpolicyness + 1) * cfg.algo.batch_size
    # The servers' own cap binds only where every backend has one (hf: 64; sglang and vLLM: none).
    backends = backends or {DEFAULT_BACKEND}  # no server (sft): the default backend's cap, as before
    caps = [backend_spec(b).max_concurrency for b in sorted(backends)]
    server_cap = ((max(caps), "+".join(sorted(backends))) if caps and all(x is not None for x in caps)
                  else None)
    value, bound = autosize.concurrency(kv, episode, cap, server_cap=server_cap)
    detail = (f"KV for {autosize.MEMORY_MARGIN:.0%} of " + ", ".join(f"{n} × {t:,} tokens" for t, n in kv)
              + f" at {episode:,} tokens an episode (a prompt, {cfg.rollout.group_size} completions); staleness bound "
              f"{cap} episodes" + (f", {server_cap[1]} cap {server_cap[0]}" if server_cap else ""))
    return autosize.AutoChoice("rollout.max_concurrent_rollouts", value, bound, detail)


def validate(cfg: ExperimentConfig) -> Plan:
    """Check every cross-group rule and return the placement plan with estimates."""
    load_plugins(cfg.plugins)  # first: plugins add the names the rules below accept
    check_ranges(cfg)  # every numeric knob of every group, against the range declared next to it
    _check_engine_sections(cfg)
    check_model_facts(cfg)  # before any rule reads the architecture (plan/recipe.py)
    _check_vision_facts(cfg)
    _check_scalars(cfg)
    resolve_hardware(cfg)  # cluster.hardware names a profile of the cluster's device kind
    spec = _resolved_spec(cfg)
    _check_reward_model(cfg, spec)
    check_rm_placement(cfg, spec)  # before the per-component rules: a component for it is the first mistake
    if cfg.workflow.reward == "judge" and generates(cfg.algo.name):
        check_judge_config(cfg.workflow.judge, workflow=cfg.workflow.name,
                           inference_names=[c.name for c in spec.inference])
    checker = _SpecChecker(spec, cfg)
    for c in spec.components:
        checker.check(c)
    n_nodes, per_node = cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    gpu_only = sorted({c.backend for c in spec.inference if backend_spec(c.backend).gpu_only})
    placements = place(spec, n_nodes, per_node, cfg.cluster.device, engine=cfg.engine.name,
                       gpu_fix=(lambda need: gpu_preset_fix(gpu_only, need)) if gpu_only else None)
    facts = ModelFacts.from_config(cfg.model)
    dev_gb = device_memory_gb(cfg.cluster.device, gpu_memory_gb(cfg), per_node)
    seq = cfg.dataset.max_prompt_len + cfg.rollout.gconfig.max_new_tokens
    plan = Plan(spec="", inferences=[], trains=[], colocated=spec.colocated, n_nodes=n_nodes,
                n_devices_per_node=per_node, device=cfg.cluster.device)
    plan.auto, auto_error = _resolve_auto(cfg, spec, facts, dev_gb, seq)
    _resolve_decoupled_loss(cfg, plan)
    mb_auto = any(a.path == "engine.max_tokens_per_mb" for a in plan.auto)
    plan.notes.extend(f"{a.path}=auto chose {a.value} (bound by {a.bound}: {a.detail})" for a in plan.auto)
    plan.warnings.extend(f"{a.path}=auto: even one sequence leaves less than {1 - autosize.MEMORY_MARGIN:.0%} of "
                         "the device free — raise d/t/p or enable engine.gradient_checkpointing"
                         for a in plan.auto if a.bound == "over margin")
    companions = _companions(cfg, facts)
    for c, pl in zip(spec.components, placements):
        d = c.dims
        if c.kind == "inference":
            conc = math.ceil(cfg.rollout.max_concurrent_rollouts / d.d)
            mem = inference_memory(facts, c.backend or DEFAULT_BACKEND, d.t, d.p, d.e, cfg.cluster.device, dev_gb,
                                   conc, seq)
            plan.inferences.append(InferencePart(c.label if c.name else c.backend or "inference",
                                                 c.backend or DEFAULT_BACKEND, d.d, d.t, d.p, d.e, c.world_size,
                                                 pl.by_node, mem))
            continue
        backend = c.backend or cfg.engine.name
        par = c.parallel()
        ffn = (ParallelStrategy(dp=c.ffn.d, tp=c.ffn.t, pp=c.ffn.p, cp=1, ep=c.ffn.e)
               if c.ffn is not None else None)
        mb = _micro_batch(cfg, par.dp, c, auto=mb_auto)
        mem = train_memory(facts, get_engine_spec(backend).sharding(cfg.engine), par,
                           ffn.tp if ffn else par.tp, cfg.engine.dtype, mb.tokens_per_mb, mb.n_micro_batches,
                           cfg.engine.gradient_checkpointing, dev_gb)
        plan.trains.append(TrainPart(c.name or backend, backend, par, c.world_size, pl.by_node, ffn, mb,
                                     mem, companions(mem), list(pl.split)))
    for c in spec.train:
        if c.backend is None:
            c.backend = cfg.engine.name
    plan.spec = spec.canonical()
    _check_keep_sampling_mask(cfg, plan)
    _check_routing_replay(cfg, plan)
    _check_weight_update(cfg, plan)
    _check_attn_impl(cfg, plan)
    check_lora(cfg, plan)
    check_vision(cfg, plan)  # the engines that train a vision tower, and freeze_vision_tower (plan/vision_rules.py)
    _memory_warnings(cfg, plan)
    _other_warnings(cfg, plan)
    check_dataset(cfg, plan)  # files, columns and knobs of the dataset group (data/checks.py)
    check_visual_servers(cfg, plan)
    validate_algo_config(cfg.algo)
    validate_group_size(cfg.algo, cfg.rollout.group_size)
    check_distill(cfg, plan)  # the teacher: its path, engine and tokenizer (plan/distill.py)
    check_reward_model(cfg)  # workflow.reward_model: knobs, export, tokenizer (plan/reward_model.py)
    note = rm_note(cfg, rm_size_ratio(cfg), plan.train.memory.weights_gb if plan.train.memory else None)
    if note:
        plan.notes.append(note)
    if auto_error is not None:
        raise auto_error
    check_packages(cfg, plan)  # last: a config mistake is named before a missing package (plan/packages.py)
    return plan


def _check_vision_facts(cfg: ExperimentConfig) -> None:
    """A vision tower (``model.vision.depth`` > 0) needs widths and heads the estimate can size."""
    v = cfg.model.vision
    if not is_vision_language(cfg.model):
        return
    if v.family not in VISION_FAMILIES:
        raise ConfigError("model.vision.family", f"{v.family!r} is not a vision tower layout areal knows",
                          f"set model.vision.family to one of: {', '.join(VISION_FAMILIES)} (the model_type of "
                          "the model's config.json)")
    for name in ("hidden_size", "intermediate_size", "num_heads"):
        if getattr(v, name) < 1:
            raise ConfigError(f"model.vision.{name}", f"is {getattr(v, name)}, but model.vision.depth={v.depth} "
                              "describes a vision tower", f"set model.vision.{name} from the model's vision_config, "
                              "or model.vision.depth=0 for a text-only model")
    if v.hidden_size % v.num_heads:
        raise ConfigError("model.vision.num_heads", f"{v.num_heads} heads do not divide model.vision.hidden_size="
                          f"{v.hidden_size}", "set the vision_config's num_heads and hidden_size")


def _resolve_decoupled_loss(cfg: ExperimentConfig, plan: Plan) -> None:
    """``algo.use_decoupled_loss=null`` becomes true exactly when an RL run's samples can be stale: a plain PPO
    ratio against a sample's behaviour logprobs then mixes policy versions (AReaL, arXiv:2505.24298: staleness
    4 without the decoupled objective loses 19 AIME points); a synchronous run needs no proximal policy."""
    if cfg.algo.use_decoupled_loss is not None:
        return
    k = cfg.rollout.max_head_offpolicyness
    on = generates(cfg.algo.name) and k > 0
    cfg.algo.use_decoupled_loss = on
    if on:
        plan.notes.append(f"algo.use_decoupled_loss=null chose true: rollout.max_head_offpolicyness={k} lets "
                          f"samples be up to {k} version{'s' if k > 1 else ''} stale (the ratio is taken against a proximal policy, "
                          f"{cfg.algo.prox_logp_method}; behaviour weights capped at "
                          f"{cfg.algo.behav_imp_weight_cap})")


def _memory_warnings(cfg: ExperimentConfig, plan: Plan) -> None:
    for t in plan.trains:
        mem = t.memory
        if mem is not None and t.total_gb > mem.device_gb:
            plan.warnings.append(
                f"train '{t.name}': estimated {t.total_gb:.1f} GB per device exceeds the device's "
                f"{mem.device_gb:.1f} GB — raise d/t/p, enable engine.gradient_checkpointing or lower "
                "engine.max_tokens_per_mb")
    for p in plan.inferences:
        mem = p.memory
        if mem is None:
            continue
        if mem.weights_gb > mem.device_gb:
            plan.warnings.append(f"inference '{p.name}': weights need {mem.weights_gb:.1f} GB per device, "
                                 f"more than the device's {mem.device_gb:.1f} GB — raise t")
        elif backend_spec(p.backend).reserves_memory and mem.kv_tokens < mem.kv_tokens_needed:
            plan.warnings.append(
                f"inference '{p.name}': KV cache holds {mem.kv_tokens} tokens per instance, "
                f"{mem.kv_tokens_needed} are needed for rollout.max_concurrent_rollouts — requests will "
                "queue; raise t or d")
    if plan.colocated:
        plan.warnings.append("colocated components share devices: generation pauses while training runs")


def _check_keep_sampling_mask(cfg: ExperimentConfig, plan: Plan) -> None:
    if not cfg.rollout.keep_sampling_mask:
        return
    if not keep_sampling_mask_active(cfg):
        plan.warnings.append("rollout.keep_sampling_mask=true has no effect: rollout.gconfig samples the whole "
                             "distribution (greedy, or top_p=1 and top_k=-1)")
        return
    others = sorted({p.backend for p in plan.inferences if not backend_spec(p.backend).sampling_mask})
    if others:
        raise ConfigError("rollout.keep_sampling_mask", f"the {', '.join(others)} server does not record "
                          "the sampling mask; only the built-in hf server does",
                          "use the hf inference backend or set rollout.keep_sampling_mask=false")
    if cfg.rollout.gconfig.min_new_tokens > 0:
        # min_new_tokens hides stop tokens from the sampler: a mask the trainer's threshold cannot rebuild.
        raise ConfigError("rollout.keep_sampling_mask", "cannot be combined with rollout.gconfig.min_new_tokens="
                          f"{cfg.rollout.gconfig.min_new_tokens} (its stop-token block is not part of the mask)",
                          "set rollout.gconfig.min_new_tokens=0 or rollout.keep_sampling_mask=false")


def _check_routing_replay(cfg: ExperimentConfig, plan: Plan) -> None:
    if not cfg.rollout.routing_replay:
        return
    key = "rollout.routing_replay"
    if cfg.model.num_experts <= 0:
        raise ConfigError(key, "needs a mixture-of-experts model; this model is dense (model.num_experts=0)",
                          "set rollout.routing_replay=false, or use an MoE model")
    # Each engine's spec says under which dims its forward replays recorded routing (engines/routing_replay.py
    # through the HF router, megatron through mcore's router seam).
    lacking = sorted({t.backend for t in plan.trains if not get_engine_spec(t.backend).routing_replay})
    if lacking:
        what = f"the {', '.join(lacking)} engine{'s' if len(lacking) > 1 else ''}"
        capable = engines_with("routing_replay")
        raise ConfigError(key, f"{what} cannot replay routing yet (supported: {', '.join(capable)})",
                          f"use engine={', '.join(capable[:-1])} or {capable[-1]}, or set rollout.routing_replay=false")
    for t in plan.trains:
        spec = get_engine_spec(t.backend)
        p = t.parallel
        sizes = {"d": p.dp, "t": p.tp, "p": p.pp, "c": p.cp, "e": p.ep}
        cut = [x for x in spec.dims if x not in spec.routing_replay]
        if any(sizes[x] > 1 for x in cut):
            under = ", ".join(spec.routing_replay[:-1]) + f" and {spec.routing_replay[-1]}"
            others = [n for n in engines_with("routing_replay")
                      if all(x in get_engine_spec(n).routing_replay and x in get_engine_spec(n).dims for x in cut)]
            use = f"use engine={' or engine='.join(others)}, or " if others else ""
            raise ConfigError(key, f"{t.backend} replays routing under {under} only (this plan has "
                              f"{''.join(f'{x}{sizes[x]}' for x in cut)})",
                              f"drop {' and '.join(cut)} from the {t.backend} dims, {use}set "
                              "rollout.routing_replay=false")
        if spec.check_routing_replay is not None:
            spec.check_routing_replay(cfg.engine)
    others = sorted({p.backend for p in plan.inferences if not backend_spec(p.backend).routed_experts})
    if others:
        raise ConfigError(key, f"the {', '.join(others)} server is not wired to return routed experts; "
                          "only the built-in hf server is (SGLang's --enable-return-routed-experts speaks "
                          "the same format but is untested here)",
                          "use the hf inference backend or set rollout.routing_replay=false")


def _check_attn_impl(cfg: ExperimentConfig, plan: Plan) -> None:
    """The kernel can run where the trainers run (the engines refuse the same at initialisation)."""
    impl = cfg.engine.attn_impl
    bf16 = cfg.engine.dtype == "bfloat16"
    for t in plan.trains:
        attn_impl.check(impl, t.backend, cfg.cluster.device, bf16_compute=bf16)
    if impl == attn_impl.FLASH and cfg.engine.shared_prefix and any(
            not get_engine_spec(t.backend).flash_shared_prefix for t in plan.trains):
        plan.warnings.append(f"engine.shared_prefix is off under engine.attn_impl={impl}: flash-attn takes no "
                             "attention mask, and the shared prefix needs one (micro-batches are packed plainly)")


def _check_weight_update(cfg: ExperimentConfig, plan: Plan) -> None:
    if plan.colocated and cfg.cluster.device == "cuda" and cfg.rollout.weight_update == "distributed" \
            and generates(cfg.algo.name):
        raise ConfigError("rollout.weight_update", "distributed pushes join trainer and servers in one NCCL "
                          "group, and this colocated plan puts them on the same GPUs (NCCL refuses two ranks "
                          "of a group on one device)",
                          "set rollout.weight_update=disk or auto, or separate them with '+' in allocation_mode")
    others = sorted({p.backend for p in plan.inferences if disk_only(p.backend)})
    if others and cfg.rollout.weight_update == "distributed" and generates(cfg.algo.name):
        raise ConfigError("rollout.weight_update", f"{', '.join(others)} cannot join the trainer's broadcast "
                          "group: its weight transfer is its own NCCL rendezvous (CUDA only; docs/inference.md)",
                          "set rollout.weight_update=disk or auto (vLLM reloads the pushed checkpoint from a "
                          "shared path)")


def _other_warnings(cfg: ExperimentConfig, plan: Plan) -> None:
    if cfg.launcher.name == "local" and cfg.cluster.n_nodes > 1:
        reason, fix = local_multi_node(cfg.cluster.n_nodes)
        plan.warnings.append(f"{reason}: `areal train` refuses it — fix: {fix}")
    notes = list(dict.fromkeys(note for p in plan.inferences if (note := backend_spec(p.backend).cpu_note)))
    if cfg.cluster.device == "cpu" and notes:
        plan.warnings.append(f"cluster.device=cpu: {' and '.join(notes)}; the plan "
                             "is valid but will only launch on matching hardware")
    if cfg.cluster.device == "cpu" and cfg.engine.dtype == "bfloat16" and _cpu_lacks_bf16():
        plan.warnings.append("engine.dtype=bfloat16 on a CPU without AMX or avx512_bf16: bf16 matmuls are "
                             "emulated here (measured 7x slower than fp32 on an AVX2 EPYC); float32 is faster")
    if is_vision_language(cfg.model):
        other = imageless_backends(p.backend for p in plan.inferences)
        plan.warnings.append(f"model.vision: {cfg.model.name} is a vision-language model; the memory estimate "
                             "counts its vision tower, the step-time model not the tower's work on image patches"
                             + (f"; `areal train` refuses {', '.join(other)} servers for it (they do not carry "
                                "images)" if other else "") + " (docs/vision.md)")
    if cfg.algo.name == "sft" and plan.inferences:
        plan.warnings.append("algo=sft does not generate: the inference component is unused")
    if cfg.algo.name == "rm" and plan.inferences:
        plan.warnings.append("algo=rm does not generate (its eval is the held-out pairwise accuracy): the "
                             "inference component is unused")
    for t in plan.trains:
        if t.split_groups:
            plan.warnings.append(f"'{t.name}': {t.backend}'s rank order {t.rank_order} spaces the ranks of "
                                 f"each {', '.join(t.split_groups)} group more than a node apart, so those "
                                 "groups span nodes (slower links); fewer d, or no e with p, keeps them on "
                                 "one node")


def gpu_presets() -> list[tuple[str, int, int]]:
    """``(option, n_nodes, n_gpus_per_node)`` of every cluster option with ``device: cuda``, smallest first."""
    import yaml

    from areal_cli.plan.groups import find_option, group_options

    out = []
    for opt in group_options().get("cluster", []):
        path = find_option("cluster", opt)
        data = yaml.safe_load(path.read_text()) if path is not None else None
        if isinstance(data, dict) and data.get("device") == "cuda":
            out.append((opt, int(data.get("n_nodes", 1)), int(data.get("n_gpus_per_node", 1))))
    return sorted(out, key=lambda p: (p[1] * p[2], p[0]))


def gpu_preset_fix(backends: list[str], need: int) -> str:
    """The fix for a GPU-only spec on a CPU cluster too small for it: the smallest GPU preset that holds it."""
    presets = gpu_presets()
    names = " and ".join(backends)
    fit = next((p for p in presets if p[1] * p[2] >= need), None)
    if fit is not None:
        pick = f"cluster={fit[0]} ({fit[1]}×{fit[2]} GPUs for the spec's {need})"
    elif presets:
        name, _, per = presets[-1]
        pick = f"cluster={name} cluster.n_nodes={-(-need // per)}"
    else:
        pick = f"cluster.device=cuda with {need} GPUs (cluster.n_nodes × cluster.n_gpus_per_node)"
    return f"{names} runs on GPUs only: use a GPU cluster, {pick}, or shrink the dims"


@functools.lru_cache(maxsize=1)
def _cpu_lacks_bf16() -> bool:
    """True when /proc/cpuinfo (Linux) lists neither AMX nor AVX512-BF16; False where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return bool(flags) and not ({"amx_bf16", "avx512_bf16"} & set(flags.split()))
