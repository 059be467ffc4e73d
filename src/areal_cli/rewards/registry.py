"""Reward functions by name (:data:`REWARDS`: ``numeric``, ``exact``, ``math``, ``code`` and plugins) or
by dotted import path. Torch-free: the validator reads the names.

A plugin registers its own (docs/architecture.md, "Registries and plugins")::

    from areal_cli.rewards.registry import register_reward

    @register_reward("my_reward", in_process=False)
    def my_reward(prompt: str, completion: str, answer, **kw) -> float: ...
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from areal_cli.errors import ConfigError
from areal_cli.registry import Registry

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class RewardSpec:
    # Cheap and cannot hang: called in the rollout process. Otherwise (math-verify, sandboxed code,
    # user functions by path) it runs in the time-bounded worker pool, so a hanging or crashing
    # reward cannot take the trainer down.
    in_process: bool = False


REWARDS: Registry[RewardSpec] = Registry("reward", "workflow.reward", RewardSpec)
REWARDS.declare("numeric", "areal_cli.rewards.builtin:numeric_reward", in_process=True)
REWARDS.declare("exact", "areal_cli.rewards.builtin:exact_reward", in_process=True)
REWARDS.declare("math", "areal_cli.rewards.math_reward:math_reward")
REWARDS.declare("code", "areal_cli.rewards.code:code_reward")
# An LLM judge (rewards/judge.py): built by the trainer from workflow.judge and the servers it calls
# (rollout/build.py:build_reward_fn), never called as a plain function. In process: its calls are
# async HTTP on the rollout's event loop, each bounded by workflow.judge.timeout_s.
REWARDS.declare("judge", "areal_cli.rewards.judge:JudgeReward", in_process=True)
JUDGE = "judge"
register_reward = REWARDS.register


def is_import_path(name: str) -> bool:
    return "." in name or ":" in name


def check_reward_name(name: str, config_path: str = "workflow.reward") -> None:
    """A registered name, or an import path whose module and attribute exist (read from the source without
    running it: the function is imported later, in the process that calls it)."""
    if not is_import_path(name):
        REWARDS.entry(name, config_path)
        return
    from areal_cli.utils.static_import import find_target

    find_target(name, config_path)


def reward_runs_in_process(name: str) -> bool:
    return not is_import_path(name) and REWARDS.spec(name).in_process


def get_reward_fn(name: str, config_path: str = "workflow.reward") -> RewardFn:
    """``fn(prompt: str, completion: str, answer: str, **kw) -> float`` for ``name`` (not ``judge``, which
    needs its servers: ``rollout/build.py:build_reward_fn``).

    A user function is named ``pkg.module.fn`` or ``pkg.module:fn`` (or registered by a plugin).
    """
    if name == JUDGE:
        raise ConfigError(config_path, "reward=judge calls an inference server and is built by the trainer "
                          "from workflow.judge", "build it with areal_cli.rollout.build.build_reward_fn(cfg, "
                          "addresses) or use a rule reward here")
    if not is_import_path(name):
        return REWARDS.entry(name, config_path).load()
    if ":" in name:
        mod, _, attr = name.partition(":")
    else:
        mod, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise ConfigError(config_path, f"cannot import module {mod!r} for reward {name!r}: {e}",
                          "check the module is on PYTHONPATH (installed or in the working directory)") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(config_path, f"{mod!r} has no callable {attr!r}",
                          "name a function taking (prompt, completion, answer, **kw) and returning a float")
    return fn
