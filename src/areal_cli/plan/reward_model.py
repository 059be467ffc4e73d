"""Rules of ``workflow.reward_model`` (a trained reward model scoring RL samples in the trainer) that read more
than the workflow group: the algorithm and workflow it can score, its export and tokenizer, where it is
placed (colocated with the actor), and its size for the memory and time estimates. Torch-free."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from areal_cli.config.algo import generates
from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

KEY = "workflow.reward_model"
VALUE_HEAD_FILE = "value_head.safetensors"  # engines/base.py's name of a critic export's head
# Names a separate train component for the reward model would carry; it is colocated instead.
RM_COMPONENT_NAMES = ("rm", "reward", "reward_model")
# Workflows whose rows are one prompt and one completion: what a reward model trained on pairs scores.
RM_WORKFLOWS = ("rlvr",)


def rm_on(cfg: ExperimentConfig) -> bool:
    return cfg.workflow.reward_model.enabled


def rm_size_ratio(cfg: ExperimentConfig) -> float:
    """The reward model's parameters over the policy's, from its config.json (1.0 when it cannot be read: a
    hub id not fetched yet is assumed the policy's size); 0.0 without one."""
    if not rm_on(cfg) or not generates(cfg.algo.name):
        return 0.0
    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.plan.recipe import _local_model_params

    rm = _local_model_params(cfg.workflow.reward_model.path)
    policy = ModelFacts.from_config(cfg.model).total_params()
    return rm / policy if rm and policy else 1.0


def check_rm_knobs(cfg: ExperimentConfig) -> None:
    """The rules that need no file: one ConfigError per mistake (pure; unit-tested). ``combine`` and
    ``normalize`` are closed sets, checked with the others (plan/validate.py ``CHOICES``)."""
    r = cfg.workflow.reward_model
    if not r.enabled:
        return
    if not generates(cfg.algo.name):
        raise ConfigError(f"{KEY}.path", f"algo={cfg.algo.name} samples no completions, and a reward model scores "
                          "RL samples", f"unset {KEY}.path, or use an RL algorithm (algo=grpo, ppo, ...)")
    if r.combine == "rm_only" and r.rule_weight != 1.0:
        raise ConfigError(f"{KEY}.rule_weight", f"{r.rule_weight} weighs the rule reward, which combine=rm_only "
                          "leaves out", f"set {KEY}.combine=sum (or gate), or leave rule_weight at 1")
    if cfg.workflow.name not in RM_WORKFLOWS:
        raise ConfigError(f"{KEY}.path", f"workflow={cfg.workflow.name} gives rows of several turns or an "
                          "agent's episode, and the reward model scores one prompt and its completion",
                          f"use workflow=rlvr, or unset {KEY}.path")
    if cfg.algo.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling", "dynamic sampling drops groups by the rule reward in the "
                          "rollout worker, before the trainer's reward model scores them",
                          f"set algo.dynamic_sampling=false, or unset {KEY}.path")


def check_rm_placement(cfg: ExperimentConfig, spec: Any) -> None:
    """The reward model runs in the actor's processes: a train component named for it is refused."""
    if not rm_on(cfg):
        return
    for c in spec.train:
        if c.name in RM_COMPONENT_NAMES:
            raise ConfigError("allocation_mode.spec", f"the train component '{c.label}' would place the reward "
                              "model apart, and it runs colocated with the actor (a forward-only copy in each "
                              "trainer process)", f"drop '{c.label}' from the spec; {KEY} needs no component")


def check_rm_export(cfg: ExperimentConfig) -> None:
    """The path resolves (a local dir or a hub id), a local dir is a reward-model export (it has the value
    head), and its tokenizer is the policy's (when both are already on disk)."""
    if not rm_on(cfg) or not generates(cfg.algo.name):
        return
    from areal_cli.models.hub import is_hub_id
    from areal_cli.models.teacher import resolve_teacher_path

    path = cfg.workflow.reward_model.path
    if not path.startswith("builtin:") and not is_hub_id(path) and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{KEY}.path", f"{path} does not exist (yet)",
                          "train the reward model first (`areal train algo=rm ...`, examples/reward_model) and "
                          "point this at its <run dir>/checkpoints/final")
    rm_dir = resolve_teacher_path(path, fetch=False, key=f"{KEY}.path", role="reward model")
    if os.path.isdir(rm_dir):
        check_export_dir(rm_dir)
        from areal_cli.plan.distill import _student_dir

        policy = _student_dir(cfg)
        if policy:
            check_rm_tokenizer(policy, rm_dir)


def check_export_dir(rm_dir: str) -> None:
    if not os.path.isfile(os.path.join(rm_dir, VALUE_HEAD_FILE)):
        raise ConfigError(f"{KEY}.path", f"{rm_dir} is not a reward-model export (no {VALUE_HEAD_FILE})",
                          "train one with `areal train algo=rm ...` and point this at its "
                          "<run dir>/checkpoints/final")


def check_rm_tokenizer(policy_dir: str, rm_dir: str) -> None:
    from areal_cli.models.teacher import check_teacher_tokenizer

    check_teacher_tokenizer(policy_dir, rm_dir, f"{KEY}.path", role="reward model",
                            fix="train the reward model from the policy's family (algo=rm with the policy's "
                                "model.path), so both read the same token ids")


def check_reward_model(cfg: ExperimentConfig) -> None:
    """The rules of ``workflow.reward_model`` validate-config checks once the plan is placed (it checks
    :func:`check_rm_placement` earlier, before the rules of each component)."""
    check_rm_knobs(cfg)
    check_rm_export(cfg)


def rm_note(cfg: ExperimentConfig, ratio: float, actor_weights_gb: float | None = None) -> str | None:
    """The plan's line on the reward model: where it runs, what it adds to a trainer rank, the reward trained on."""
    if not rm_on(cfg) or not generates(cfg.algo.name):
        return None
    r = cfg.workflow.reward_model
    how = {"rm_only": f"{r.weight:g} × score", "sum": f"{r.rule_weight:g} × rule + {r.weight:g} × score",
           "gate": f"{r.rule_weight:g} × rule + {r.weight:g} × score where the rule passes"}.get(r.combine, r.combine)
    size = (f"+{ratio * actor_weights_gb:.2f} GB of frozen weights per device ({ratio:.2g}× the actor's)"
            if actor_weights_gb is not None else f"{ratio:.2g}× the actor's weights")
    return (f"{KEY}: {r.path} scores every completion in the trainer, a forward-only copy colocated with the "
            f"actor ({size}, counted by `areal plan` and the auto micro-batch); reward = {how}"
            f"{' (batch-normalised score)' if r.normalize == 'batch' else ''}; the held-out eval stays "
            f"workflow.reward={cfg.workflow.reward}")
