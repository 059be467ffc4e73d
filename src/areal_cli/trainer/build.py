"""Small wiring functions: each turns one config group into one live object.

The loops in rl.py / sft.py only call these, so swapping a part (another engine, workflow or
launcher) never touches a loop. Heavy imports stay inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError, DataError
from areal_cli.rollout.build import lora_enabled
from areal_cli.job.layout import JobLayout, ServerSpec, TrainerSpec

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


# ---------------------------------------------------------------- CLI-process side (no torch)

def resolve_model_path(cfg: ExperimentConfig, *, fetch: bool = True) -> str:
    """``builtin:<spec>`` → the cached built-in model dir (built on first use); a hub id → its snapshot in the
    HF cache (downloaded first; ``fetch=False``: the id itself, for launchers whose nodes fetch it); else a
    local HF dir.

    The ``model`` group's architecture facts are what validation checked, so they decide the
    built model (``model.hidden_size=256`` builds and caches a 256-wide one).
    """
    path = cfg.model.path
    if isinstance(path, str) and path.startswith("builtin:"):
        from areal_cli.data.builtin_model import (BUILTIN_SPECS, ensure_builtin_model,
                                                  overrides_from_model_config)

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


def layout_from_plan(cfg: ExperimentConfig, plan: Any | None) -> JobLayout:
    """Flatten the validated plan (``plan.validate.validate``) into a :class:`JobLayout`.

    Each inference part becomes ``dp`` servers on consecutive ``tp×pp`` device blocks of its
    placement; the train part becomes one torchrun job over the nodes of its placement.
    """
    if plan is None:
        from areal_cli.plan.validate import validate

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


def build_engine(cfg: ExperimentConfig, layout: JobLayout, model_path: str, *, optim: Any | None = None,
                 total_steps: int | None = None, critic: bool = False, lora: bool = True,
                 engine_name: str | None = None, peers: tuple = ()) -> Any:
    """The training engine named by ``engine.name`` (or ``engine_name``), initialised on the plan's parallel
    strategy. ``lora=False``: all weights train even under ``model.lora`` (the SFT warm start). ``peers``: the
    engines of this process it lives beside (``TrainEngine.initialize``)."""
    from areal_cli.api.io_struct import ParallelStrategy

    from areal_cli.engines import get_engine_cls

    t = layout.trainer
    cls = get_engine_cls(engine_name or cfg.engine.name)
    kwargs: dict[str, Any] = {"total_steps": total_steps or cfg.trainer.total_steps, "seed": cfg.seed}
    if critic:
        kwargs["critic"] = True
    elif lora and lora_enabled(cfg):  # only engines with LoRA get it (validated: plan/lora_rules.py)
        kwargs["lora"] = cfg.model.lora
    engine = cls(cfg.engine, optim if optim is not None else cfg.algo.optim, **kwargs)
    extra = {"freeze_vision_tower": True} if getattr(cfg.model, "freeze_vision_tower", False) else {}
    engine.initialize(ParallelStrategy(dp=t.dp, tp=t.tp, pp=t.pp, cp=t.cp, ep=t.ep, etp=t.etp), model_path,
                      peers=peers, **extra)
    return engine


def build_reference(cfg: ExperimentConfig, layout: JobLayout, model_path: str, engine: Any) -> Any | None:
    """The KL reference (``algo.kl_coef > 0``): under LoRA the policy's own model with the adapter
    disabled (no second copy of the weights), else a second engine on the initial weights."""
    if cfg.algo.kl_coef <= 0:
        return None
    if lora_enabled(cfg):
        from areal_cli.engines.lora import ReferenceView

        return ReferenceView(engine)
    return build_engine(cfg, layout, model_path, peers=(engine,))


def build_teacher(cfg: ExperimentConfig, layout: JobLayout, model_path: str,
                  peers: tuple = ()) -> Any | None:
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
    return build_engine(cfg, layout, teacher_dir, lora=False, engine_name=d.engine or None, peers=peers)


def build_reward_model(cfg: ExperimentConfig, layout: JobLayout, model_path: str, tokenizer: Any,
                       peers: tuple = ()) -> Any | None:
    """The scorer of ``workflow.reward_model`` (algorithms/rm_reward.py): the ``algo=rm`` export as a
    forward-only critic engine of the trainer's engine class in this process, like the distillation teacher
    (no optimizer state, never an adapter); the policy's tokenizer, checked here too, for launchers whose
    nodes resolve the paths."""
    r = cfg.workflow.reward_model
    if not r.enabled:
        return None
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.algorithms.rm_reward import RewardModelScorer
    from areal_cli.engines import get_engine_cls
    from areal_cli.models.teacher import resolve_teacher_path
    from areal_cli.plan.reward_model import KEY, check_export_dir, check_rm_tokenizer
    from areal_cli.algorithms.reward_model import read_token_id

    rm_dir = resolve_teacher_path(r.path, key=f"{KEY}.path", role="reward model")
    check_export_dir(rm_dir)
    check_rm_tokenizer(model_path, rm_dir)
    t = layout.trainer
    engine = get_engine_cls(cfg.engine.name)(cfg.engine, None, critic=True, total_steps=cfg.trainer.total_steps,
                                             seed=cfg.seed)
    engine.initialize(ParallelStrategy(dp=t.dp, tp=t.tp, pp=t.pp, cp=t.cp, ep=t.ep, etp=t.etp), rm_dir,
                      peers=peers)
    reduce = engine.dp_all_reduce if engine.dp_world_size > 1 else None
    return RewardModelScorer(r, engine, tokenizer, use_chat_template=cfg.dataset.use_chat_template,
                             read_id=read_token_id(tokenizer), reduce=reduce)


def build_datasets(cfg: ExperimentConfig, tokenizer: Any) -> tuple[list[dict], list[dict]]:
    """(train items, test items) per the ``dataset`` group (``areal_cli.data.datasets.load_split``);
    the test list is empty when a local dataset has no ``test_path``."""
    from areal_cli.data.datasets import load_split

    train, _ = load_split(cfg.dataset, tokenizer, "train", seed=cfg.seed)
    test_split = load_split(cfg.dataset, tokenizer, "test", seed=cfg.seed)
    test = test_split[0] if test_split is not None else []
    if not train:
        raise DataError(f"dataset.train_path={cfg.dataset.train_path} yielded no usable rows")
    return train, test


def build_actor(cfg: ExperimentConfig, engine: Any, ref_engine: Any | None,
                teacher_engine: Any | None = None) -> Any:
    from areal_cli.algorithms.actor import PPOActor

    # Each rank holds whole groups of the step's batch, so batch-level statistics (batch mean/std,
    # REINFORCE++ whitening, adv_norm) need a sum over the data-parallel ranks.
    reduce = engine.dp_all_reduce if engine.dp_world_size > 1 else None
    return PPOActor(cfg.algo, engine, ref_engine=ref_engine, group_size=cfg.rollout.group_size,
                    max_new_tokens=cfg.rollout.gconfig.max_new_tokens, dp_allreduce=reduce,
                    teacher_engine=teacher_engine)


def build_critic(cfg: ExperimentConfig, engine: Any) -> Any:
    from areal_cli.algorithms.critic import PPOCritic

    return PPOCritic(cfg.algo, engine)
