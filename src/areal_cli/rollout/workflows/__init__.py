"""Workflow registry: built-in names, plugins, and user workflows by dotted import path.

``workflow.name=rlvr`` / ``multi_turn`` / ``agent`` / ``agent_proxy`` / ``online`` select the built-ins; a plugin module
(named in ``plugins=[...]``) adds its own with ``@register_workflow("name")``; anything containing a dot
is imported: ``my_pkg.module.MyWorkflow`` or ``my_pkg.module:MyWorkflow`` (a RolloutWorkflow subclass,
or a factory callable returning an instance). The trainer builds a workflow from the config with
``rollout/build.py:build_workflow`` (the one place that wires reward, generation config and
constructor arguments); :func:`build_workflow` here is the constructor call it ends in.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from areal_cli.api.workflow_api import RolloutWorkflow
from areal_cli.errors import ConfigError
from areal_cli.registry import RegistrationError, Registry, _describe

# The trainer-level pieces a workflow constructor may name; each comes from its own config key or, for
# ``run_dir``, from the run itself (so they are refused in workflow.kwargs). A constructor gets the ones it
# names (all but ``run_dir`` with **kwargs: one that forwards them to a built-in would not expect it), plus
# workflow.kwargs.
OFFERED = ("reward_fn", "gconfig", "tokenizer", "group_size", "max_turns", "turn_discount", "feedback",
           "run_dir")


def _check_workflow(name: str, obj: Any, spec: Any) -> None:
    if inspect.isclass(obj) and not issubclass(obj, RolloutWorkflow) and not hasattr(obj, "arun_episode"):
        raise RegistrationError(f"workflow {name!r}: {_describe(obj)} is a class but not a RolloutWorkflow; "
                                "subclass areal_cli.api.workflow_api.RolloutWorkflow and define async arun_episode")
    if not callable(obj):
        raise RegistrationError(f"workflow {name!r}: {obj!r} is not a class or factory")


WORKFLOWS: Registry = Registry("workflow", "workflow.name", check=_check_workflow)
WORKFLOWS.declare("rlvr", "areal_cli.rollout.workflows.rlvr:RLVRWorkflow")
WORKFLOWS.declare("multi_turn", "areal_cli.rollout.workflows.multi_turn:MultiTurnWorkflow")
WORKFLOWS.declare("agent", "areal_cli.rollout.workflows.agent:AgentWorkflow")
WORKFLOWS.declare("online", "areal_cli.rollout.workflows.online:OnlineAgentWorkflow")
WORKFLOWS.declare("agent_proxy", "areal_cli.rollout.workflows.agent_proxy:ProxyAgentWorkflow")


def register_workflow(name: str, target: Any = None) -> Any:
    """Register ``name`` for a workflow class/factory (or its ``module:attr`` path). Without
    ``target`` it is a class decorator: ``@register_workflow("mine")``."""
    if target is None:
        return WORKFLOWS.register(name)
    WORKFLOWS.declare(name, target)
    return target


def available_workflows() -> list[str]:
    return list(WORKFLOWS.names())


def is_import_path(name: str) -> bool:
    return "." in name or ":" in name


def check_workflow_config(name: str, kwargs: dict[str, Any], group_size: int | None = None) -> None:
    """Torch-free checks the validator runs: a registered name or an import path whose module and
    attribute exist (read statically, :mod:`areal_cli.utils.static_import`), ``workflow.kwargs`` the
    constructor takes and none that has its own config key, the agent workflow's
    ``workflow.kwargs.agent`` and the online workflow's group size. What the source cannot tell is left
    to the process that builds it."""
    from areal_cli.utils.static_import import find_target

    kwargs = dict(kwargs or {})
    clash = sorted(set(OFFERED) & set(kwargs))
    if clash:
        raise ConfigError("workflow.kwargs", f"{clash} are set by their own config keys, not workflow.kwargs",
                          "use workflow.max_turns / workflow.turn_discount / workflow.feedback / "
                          "rollout.group_size / rollout.gconfig / workflow.reward instead (run_dir is the "
                          "run's own)")
    target = name if is_import_path(name) else WORKFLOWS.entry(name, "workflow.name").target
    found = find_target(target, "workflow.name") if isinstance(target, str) else target
    _check_kwargs(name, found, kwargs)
    if name == "agent":
        _check_agent(kwargs.get("agent"))
    elif target == WORKFLOWS.entry("agent_proxy", "workflow.name").target:
        check_proxy_agent(kwargs.get("command"), kwargs.get("agent"))
        if kwargs.get("agent") is not None:
            _check_agent(kwargs["agent"])
    if name == "online" and group_size is not None:
        check_online_group_size(group_size)


def check_proxy_agent(command: Any, agent: Any) -> None:
    """The proxy workflow runs exactly one of an agent command and an in-process agent."""
    if bool(command) == (agent is not None):
        raise ConfigError("workflow.kwargs.command", "the proxy workflow runs either an agent command or an "
                          f"in-process agent, got {'both' if command else 'neither'}",
                          "set workflow.kwargs.command='python my_agent.py' or "
                          "workflow.kwargs.agent=my_pkg.mod:my_agent (async (base_url, api_key, data))")


def check_online_group_size(group_size: Any) -> None:
    """``workflow=online`` trains each session on its own: the service, not the trainer, decides what a
    session is about, so there is no group of samples of one prompt."""
    if group_size != 1:
        raise ConfigError("rollout.group_size", f"workflow=online trains one session per episode, got "
                          f"group_size={group_size!r}: the agent service decides what each session is "
                          "about, so there is no group of samples of one prompt",
                          "set rollout.group_size=1 with an estimator without a group baseline "
                          "(algo=reinforce_pp, or algo.mean_level=batch algo.std_level=batch)")


def _check_kwargs(name: str, found: Any, kwargs: dict[str, Any]) -> None:
    from areal_cli.errors import did_you_mean
    from areal_cli.utils.static_import import parameters

    params = parameters(found)
    if params is None or params[1]:
        return
    unknown = sorted(set(kwargs) - set(params[0]))
    if unknown:
        own = [p for p in params[0] if p not in OFFERED]
        raise ConfigError("workflow.kwargs", f"workflow {name} does not accept the argument {unknown[0]!r}",
                          f"{did_you_mean(unknown[0], own)}its arguments: {', '.join(own) or 'none'}")


def _check_agent(agent: Any) -> None:
    from areal_cli.utils.static_import import find_target, is_sync_function

    path = "workflow.kwargs.agent"
    if agent is None:
        raise ConfigError(path, "workflow.name=agent runs an agent, and none is given",
                          "set workflow.kwargs.agent=my_pkg.mod:my_agent (an async function)")
    if not isinstance(agent, str) and not callable(agent):  # a callable: set from Python, not a config file
        raise ConfigError(path, f"must be an import path, got {type(agent).__name__}",
                          "set workflow.kwargs.agent=my_pkg.mod:my_agent (an async function)")
    if is_sync_function(find_target(agent, path) if isinstance(agent, str) else agent):
        raise ConfigError(path, f"{agent} is not an async function",
                          "define `async def agent(client, data) -> reward` and name it module:function")


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
    if not is_import_path(name_or_path):
        return WORKFLOWS.entry(name_or_path, "workflow.name").load()
    obj = import_object(name_or_path)
    try:
        _check_workflow(name_or_path, obj, None)
    except RegistrationError as e:
        raise ConfigError("workflow.name", str(e), "point workflow.name at a RolloutWorkflow subclass") from e
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
                   feedback: str = "Your answer is wrong. Try again.", run_dir: str | None = None,
                   **user_kwargs: Any) -> RolloutWorkflow:
    """Construct a workflow from trainer-level pieces (:data:`OFFERED`): its constructor gets
    ``user_kwargs`` plus whichever pieces it names (all of them if it takes ``**kwargs``).
    Built-ins and plugins alike; ``rollout/build.py:build_workflow`` makes the pieces from the config.
    ``run_dir``: the run's directory (None outside a run, e.g. a workflow built for a test)."""
    offered = {"reward_fn": reward_fn, "gconfig": gconfig, "tokenizer": tokenizer, "group_size": group_size,
               "max_turns": max_turns, "turn_discount": turn_discount, "feedback": feedback,
               "run_dir": run_dir}
    factory = resolve_workflow(name_or_path)
    try:
        params = inspect.signature(factory).parameters
    except ValueError:
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if (takes_all and k != "run_dir") or k in params}
    kwargs.update(user_kwargs)
    return load_workflow(name_or_path, **kwargs)


def _param_names(factory: Any) -> list[str]:
    try:
        return [p for p in inspect.signature(factory).parameters if p != "self"]
    except (TypeError, ValueError):
        return []


__all__ = ["OFFERED", "WORKFLOWS", "available_workflows", "build_workflow", "check_online_group_size",
           "check_proxy_agent",
           "check_workflow_config", "import_object", "load_workflow", "register_workflow", "resolve_workflow"]
