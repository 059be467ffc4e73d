"""Workflow registry: built-in names and user workflows by dotted import path.

``workflow.name=rlvr`` / ``multi_turn`` select the built-ins; anything containing a dot is imported:
``my_pkg.module.MyWorkflow`` or ``my_pkg.module:MyWorkflow`` (a RolloutWorkflow subclass, or a
factory callable returning an instance).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from areal_cli.api.workflow_api import RolloutWorkflow
from areal_cli.errors import ConfigError

_REGISTRY: dict[str, str | Any] = {
    "rlvr": "areal_cli.rollout.workflows.rlvr:RLVRWorkflow",
    "multi_turn": "areal_cli.rollout.workflows.multi_turn:MultiTurnWorkflow",
    "agent": "areal_cli.rollout.workflows.agent:AgentWorkflow",
}


def register_workflow(name: str, target: str | Any) -> None:
    """Register a short name for a workflow class/factory (or its ``module:attr`` path)."""
    _REGISTRY[name] = target


def available_workflows() -> list[str]:
    return sorted(_REGISTRY)


def import_object(path: str, config_path: str = "workflow.name") -> Any:
    """Import ``pkg.mod.Attr`` or ``pkg.mod:Attr`` with a typed error naming ``config_path``."""
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise ConfigError(config_path, f"{path!r} is not a dotted import path",
                          "use package.module.ClassName or package.module:ClassName")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(config_path, f"cannot import module {mod_name!r}: {e}",
                          "check the spelling and that the package is on PYTHONPATH") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(config_path, f"module {mod_name!r} has no attribute {attr!r}",
                              f"define {attr} in {mod_name} or fix the path")
        obj = getattr(obj, part)
    return obj


def resolve_workflow(name_or_path: str) -> Any:
    """The class (or factory) for a registered name or an import path."""
    target = _REGISTRY.get(name_or_path)
    if target is None:
        if "." not in name_or_path and ":" not in name_or_path:
            raise ConfigError("workflow.name", f"unknown workflow {name_or_path!r}",
                              f"use one of {available_workflows()} or a dotted path like "
                              "my_pkg.mod.MyWorkflow")
        target = name_or_path
    obj = import_object(target) if isinstance(target, str) else target
    if inspect.isclass(obj) and not issubclass(obj, RolloutWorkflow) and not hasattr(obj, "arun_episode"):
        raise ConfigError("workflow.name", f"{name_or_path} is a class but not a RolloutWorkflow",
                          "subclass areal_cli.api.workflow_api.RolloutWorkflow and define async arun_episode")
    if not callable(obj):
        raise ConfigError("workflow.name", f"{name_or_path} is not a class or factory",
                          "point workflow.name at a RolloutWorkflow subclass")
    return obj


def load_workflow(name_or_path: str, **kwargs: Any) -> RolloutWorkflow:
    """Instantiate a workflow; kwargs go to its constructor (a bad keyword is a ConfigError)."""
    factory = resolve_workflow(name_or_path)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ConfigError("workflow.kwargs", f"{name_or_path} does not accept these arguments: {e}",
                          f"arguments it takes: {_param_names(factory)}") from e
    except ValueError:  # no introspectable signature (C callables); let the call decide
        pass
    wf = factory(**kwargs)
    if not hasattr(wf, "arun_episode"):
        raise ConfigError("workflow.name", f"{name_or_path} returned {type(wf).__name__}, not a workflow",
                          "the factory must return a RolloutWorkflow")
    return wf


def build_workflow(name_or_path: str, *, reward_fn: Any, gconfig: Any, tokenizer: Any, group_size: int,
                   max_turns: int = 2, turn_discount: float = 0.9,
                   feedback: str = "Your answer is wrong. Try again.", **user_kwargs: Any) -> RolloutWorkflow:
    """Build a workflow from trainer-level pieces. Built-ins get what they need; a user workflow gets
    ``user_kwargs`` plus whichever of ``reward_fn``/``gconfig``/``tokenizer``/``group_size``/
    ``max_turns``/``turn_discount``/``feedback`` its constructor names (all of them if it takes
    ``**kwargs``)."""
    common: dict[str, Any] = {"reward_fn": reward_fn, "gconfig": gconfig, "tokenizer": tokenizer,
                              "group_size": group_size}
    if name_or_path == "rlvr":
        return load_workflow(name_or_path, **common, **user_kwargs)
    if name_or_path == "multi_turn":
        return load_workflow(name_or_path, **common, max_turns=max_turns, turn_discount=turn_discount,
                             feedback=feedback, **user_kwargs)
    offered = {**common, "max_turns": max_turns, "turn_discount": turn_discount, "feedback": feedback}
    factory = resolve_workflow(name_or_path)
    try:
        params = inspect.signature(factory).parameters
    except ValueError:
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    kwargs.update(user_kwargs)
    return load_workflow(name_or_path, **kwargs)


def build_reward_fn(workflow_cfg: Any) -> Any:
    """``workflow.reward`` → an :class:`areal_cli.rewards.AsyncRewardRunner` (process pool, timeouts).
    Close it (``.close()``) when the run ends."""
    from areal_cli.rewards import AsyncRewardRunner, get_reward_fn

    get_reward_fn(workflow_cfg.reward)  # fail fast on a bad name, in this process
    return AsyncRewardRunner(workflow_cfg.reward, max_workers=workflow_cfg.reward_workers,
                             timeout_s=workflow_cfg.reward_timeout_s)


def build_workflow_from_config(workflow_cfg: Any, rollout_cfg: Any, tokenizer: Any,
                               reward_fn: Any = None) -> RolloutWorkflow:
    """The trainer's one-liner: ``workflow`` + ``rollout`` config groups → a workflow instance.
    ``reward_fn`` defaults to :func:`build_reward_fn` (the caller owns closing it)."""
    from areal_cli.rollout.workflows.common import to_generation_config

    user = dict(workflow_cfg.kwargs or {})
    reserved = {"reward_fn", "gconfig", "tokenizer", "group_size", "max_turns", "turn_discount", "feedback"}
    clash = sorted(reserved & set(user))
    if clash:
        raise ConfigError("workflow.kwargs", f"{clash} are set by their own config keys, not workflow.kwargs",
                          "use workflow.max_turns / workflow.turn_discount / workflow.feedback / "
                          "rollout.group_size / rollout.gconfig / workflow.reward instead")
    return build_workflow(workflow_cfg.name, reward_fn=reward_fn or build_reward_fn(workflow_cfg),
                          gconfig=to_generation_config(rollout_cfg.gconfig), tokenizer=tokenizer,
                          group_size=rollout_cfg.group_size, max_turns=workflow_cfg.max_turns,
                          turn_discount=workflow_cfg.turn_discount, feedback=workflow_cfg.feedback,
                          **user)


def _param_names(factory: Any) -> list[str]:
    try:
        return [p for p in inspect.signature(factory).parameters if p != "self"]
    except (TypeError, ValueError):
        return []


__all__ = ["available_workflows", "build_reward_fn", "build_workflow", "build_workflow_from_config",
           "import_object", "load_workflow", "register_workflow",
           "resolve_workflow"]
