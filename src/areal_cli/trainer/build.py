"""Small wiring functions: each turns one config group into one live object.

The loops in rl.py / sft.py only call these, so swapping a part (another engine, workflow or
launcher) never touches a loop. Heavy imports stay inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from areal_cli.errors import ConfigError, DataError
from areal_cli.launchers.base import SERVER_KEY_ENV, JobLayout, ServerSpec, TrainerSpec


# ---------------------------------------------------------------- CLI-process side (no torch)

def resolve_model_path(cfg: Any, *, fetch: bool = True) -> str:
    """``builtin:<spec>`` → the cached built-in model dir (built on first use); a hub id → its snapshot in the
    HF cache (downloaded first; ``fetch=False``: the id itself, for launchers whose nodes fetch it); else a
    local HF dir.

    The ``model`` group's architecture facts are what validation checked, so they decide the
    built model (``model.hidden_size=256`` builds and caches a 256-wide one).
    """
    path = cfg.model.path
    if isinstance(path, str) and path.startswith("builtin:"):
        from areal_cli.data.builtin_model import BUILTIN_SPECS, ensure_builtin_model, overrides_from_model_config

        spec = path.split(":", 1)[1] or "tiny"
        if spec not in BUILTIN_SPECS:
            raise ConfigError("model.path", f"unknown built-in model {path!r}",
                              f"use one of: {', '.join('builtin:' + s for s in BUILTIN_SPECS)}")
        return str(ensure_builtin_model(os.path.expanduser(cfg.cluster.fileroot), spec,
                                        overrides=overrides_from_model_config(cfg.model)))
    from areal_cli.models.hub import ensure_hub_model, is_hub_id

    if is_hub_id(path):
        return ensure_hub_model(path, cfg.model.revision) if fetch else path
    p = Path(os.path.expanduser(path))
    if not (p / "config.json").is_file():
        raise ConfigError("model.path", f"{path} is not a local HF model dir (no config.json)",
                          "point model.path at a directory written by save_pretrained, or use builtin:tiny")
    return str(p.resolve())


def layout_from_plan(cfg: Any, plan: Any | None) -> JobLayout:
    """Flatten the validated plan (``config.validate.validate``) into a :class:`JobLayout`.

    Each inference part becomes ``dp`` servers on consecutive ``tp×pp`` device blocks of its
    placement; the train part becomes one torchrun job over the nodes of its placement.
    """
    if plan is None:
        from areal_cli.config.validate import validate

        plan = validate(cfg)
    servers: list[ServerSpec] = []
    for part in plan.inferences:
        flat = [(node, d) for node, devs in part.placement for d in devs]
        width = part.tp * part.pp
        for i in range(part.dp):
            block = flat[i * width:(i + 1) * width]
            servers.append(ServerSpec(index=len(servers), backend=part.backend, tp=part.tp, pp=part.pp,
                                      node=block[0][0], devices=[d for _, d in block]))
    train = plan.train
    par = train.parallel
    nodes = [node for node, _ in train.placement]
    per_node = max(len(devs) for _, devs in train.placement)
    if nodes != list(range(nodes[0], nodes[0] + len(nodes))):
        raise ConfigError("allocation_mode.spec", f"the trainer is placed on non-consecutive nodes {nodes}",
                          "reorder the spec so the train component gets a contiguous node range")
    trainer = TrainerSpec(backend=train.backend, dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep,
                          etp=par.etp,
                          nnodes=len(nodes), nproc_per_node=per_node, first_node=nodes[0])
    return JobLayout(n_nodes=plan.n_nodes, device=plan.device, servers=servers, trainer=trainer,
                     colocated=plan.colocated)


# ---------------------------------------------------------------- trainer side

def build_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def build_engine(cfg: Any, layout: JobLayout, model_path: str, *, optim: Any | None = None,
                 total_steps: int | None = None, critic: bool = False, lora: bool = True,
                 engine_name: str | None = None) -> Any:
    """The training engine named by ``engine.name`` (or ``engine_name``), initialised on the plan's parallel
    strategy. ``lora=False``: all weights train even under ``model.lora`` (the SFT warm start)."""
    from areal_cli.api.io_struct import ParallelStrategy

    from areal_cli.engines import get_engine_cls

    t = layout.trainer
    cls = get_engine_cls(engine_name or cfg.engine.name)
    kwargs: dict[str, Any] = {"total_steps": total_steps or cfg.trainer.total_steps, "seed": cfg.seed}
    if critic:
        kwargs["critic"] = True
    elif lora and lora_enabled(cfg):  # only engines with LoRA get it (validated: config/lora_rules.py)
        kwargs["lora"] = cfg.model.lora
    engine = cls(cfg.engine, optim if optim is not None else cfg.algo.optim, **kwargs)
    engine.initialize(ParallelStrategy(dp=t.dp, tp=t.tp, pp=t.pp, cp=t.cp, ep=t.ep, etp=t.etp), model_path)
    return engine


def build_client(cfg: Any, addresses: list[str], backend: str, tp_sizes: list[int] | int = 1, *,
                 adapter: bool = True) -> Any:
    """``tp_sizes``: each server's TP size (every TP rank joins the weight-update group). Under LoRA the
    client names the served adapter in every request; ``adapter=False``: the servers' base weights."""
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.weight_sync.lora import SERVED_NAME

    return RemoteInferenceEngine(addresses, backend=backend, timeout_s=cfg.rollout.request_timeout_s,
                                 retries=cfg.rollout.request_retries, routing=cfg.rollout.routing,
                                 tp_sizes=tp_sizes, api_key=os.environ.get(SERVER_KEY_ENV) or None,
                                 lora_name=SERVED_NAME if adapter and lora_enabled(cfg) else None)


def lora_enabled(cfg: Any) -> bool:
    """``model.lora.rank > 0``: the policy trains an adapter and the servers serve it by name."""
    lora = getattr(getattr(cfg, "model", None), "lora", None)
    return lora is not None and int(lora.rank) > 0


def build_reference(cfg: Any, layout: JobLayout, model_path: str, engine: Any) -> Any | None:
    """The KL reference (``algo.kl_coef > 0``): under LoRA the policy's own model with the adapter
    disabled (no second copy of the weights), else a second engine on the initial weights."""
    if cfg.algo.kl_coef <= 0:
        return None
    if lora_enabled(cfg):
        from areal_cli.engines.lora import ReferenceView

        return ReferenceView(engine)
    return build_engine(cfg, layout, model_path)


def build_teacher(cfg: Any, layout: JobLayout, model_path: str) -> Any | None:
    """The frozen teacher of on-policy distillation (``algo.distill.teacher_path``): a second forward-only
    engine in the trainer process, like the KL reference, of the student's engine class unless
    ``algo.distill.engine`` names another; any size, but the student's tokenizer (checked here too, for
    launchers whose nodes resolve the paths). Never an adapter: LoRA applies to the student only."""
    d = cfg.algo.distill
    if not d.enabled:
        return None
    from areal_cli.models.teacher import check_teacher_tokenizer, resolve_teacher_path

    teacher_dir = resolve_teacher_path(d.teacher_path)
    check_teacher_tokenizer(model_path, teacher_dir)
    return build_engine(cfg, layout, teacher_dir, lora=False, engine_name=d.engine or None)


def build_gconfig(settings: Any, tokenizer: Any, **override: Any) -> Any:
    from areal_cli.api.io_struct import GenerationConfig

    g = GenerationConfig(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                         max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens,
                         stop=list(settings.stop), greedy=settings.greedy,
                         stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return g.new(**override) if override else g


def build_reward_fn(cfg: Any, addresses: list[str] | None = None) -> Any:
    """Rewards declared ``in_process`` (the cheap built-ins) run in-process; others (math-verify,
    code, user functions) in the time-bounded process pool, so a hanging or crashing reward cannot
    take the trainer down. A bad name fails here, before any worker is spawned.

    ``judge``: an LLM judge (rewards/judge.py) calling ``addresses`` (the run's inference servers,
    ``workflow.judge.server=rollout``) or ``workflow.judge.base_url``."""
    from areal_cli.rewards.registry import JUDGE, get_reward_fn, reward_runs_in_process
    from areal_cli.rewards.runner import AsyncRewardRunner

    w = cfg.workflow
    if w.reward == JUDGE:
        from areal_cli.rewards.judge import JudgeReward

        return JudgeReward(w.judge, addresses, api_key=os.environ.get(SERVER_KEY_ENV) or None)
    fn = get_reward_fn(w.reward)
    if reward_runs_in_process(w.reward):
        return fn
    return AsyncRewardRunner(w.reward, max_workers=w.reward_workers, timeout_s=w.reward_timeout_s)


def build_workflow(cfg: Any, tokenizer: Any, gconfig: Any | None = None, reward_fn: Any | None = None,
                   addresses: list[str] | None = None) -> Any:
    """The one place a workflow is wired from the config: ``workflow.name`` (built-in, plugin or
    import path) with the reward (:func:`build_reward_fn`), the generation config
    (:func:`build_gconfig`: stops on the tokenizer's EOS) and ``workflow.*`` / ``rollout.group_size``;
    the caller owns closing a reward pool it did not pass in."""
    from areal_cli.rollout.workflows import build_workflow as _build
    from areal_cli.rollout.workflows import check_workflow_config

    w = cfg.workflow
    check_workflow_config(w.name, dict(w.kwargs))
    if gconfig is None:
        gconfig = build_gconfig(cfg.rollout.gconfig, tokenizer)
    return _build(w.name, reward_fn=reward_fn if reward_fn is not None else build_reward_fn(cfg, addresses),
                  gconfig=gconfig, tokenizer=tokenizer, group_size=cfg.rollout.group_size,
                  max_turns=w.max_turns, turn_discount=w.turn_discount, feedback=w.feedback, **dict(w.kwargs))


def build_datasets(cfg: Any, tokenizer: Any) -> tuple[list[dict], list[dict]]:
    """(train items, test items) per the ``dataset`` group (``areal_cli.data.datasets.load_split``);
    the test list is empty when a local dataset has no ``test_path``."""
    from areal_cli.data.datasets import load_split

    train, _ = load_split(cfg.dataset, tokenizer, "train", seed=cfg.seed)
    test_split = load_split(cfg.dataset, tokenizer, "test", seed=cfg.seed)
    test = test_split[0] if test_split is not None else []
    if not train:
        raise DataError(f"dataset.train_path={cfg.dataset.train_path} yielded no usable rows")
    return train, test


def build_actor(cfg: Any, engine: Any, ref_engine: Any | None, teacher_engine: Any | None = None) -> Any:
    from areal_cli.algorithms.actor import PPOActor

    # Each rank holds whole groups of the step's batch, so batch-level statistics (batch mean/std,
    # REINFORCE++ whitening, adv_norm) need a sum over the data-parallel ranks.
    reduce = engine.dp_all_reduce if engine.dp_world_size > 1 else None
    return PPOActor(cfg.algo, engine, ref_engine=ref_engine, group_size=cfg.rollout.group_size,
                    max_new_tokens=cfg.rollout.gconfig.max_new_tokens, dp_allreduce=reduce,
                    teacher_engine=teacher_engine)


def build_critic(cfg: Any, engine: Any) -> Any:
    from areal_cli.algorithms.critic import PPOCritic

    return PPOCritic(cfg.algo, engine)


def build_executor(cfg: Any, client: Any, workflow: Any, batch_size: int) -> Any:
    from areal_cli.rollout.executor import RolloutExecutor
    from areal_cli.rollout.filters import has_reward_variance

    return RolloutExecutor(client, workflow, batch_size=batch_size,
                           max_concurrent=cfg.rollout.max_concurrent_rollouts,
                           max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                           queue_size=cfg.rollout.queue_size,
                           # DAPO dynamic sampling: all-equal-reward groups are rejected (free capacity)
                           should_accept=has_reward_variance if cfg.algo.dynamic_sampling else None,
                           reject_patience=cfg.algo.dynamic_sampling_patience * batch_size
                           if cfg.algo.dynamic_sampling else 0)
