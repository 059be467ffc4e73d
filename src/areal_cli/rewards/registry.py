"""Reward functions by name: ``numeric``, ``exact``, ``math``, ``code`` or a dotted import path."""

from __future__ import annotations

import importlib
from typing import Callable

from areal_cli.errors import ConfigError

RewardFn = Callable[..., float]

BUILTIN_REWARDS = {
    "numeric": ("areal_cli.rewards.builtin", "numeric_reward"),
    "exact": ("areal_cli.rewards.builtin", "exact_reward"),
    "math": ("areal_cli.rewards.math_reward", "math_reward"),
    "code": ("areal_cli.rewards.code", "code_reward"),
}


def get_reward_fn(name: str, config_path: str = "workflow.reward") -> RewardFn:
    """``fn(prompt: str, completion: str, answer: str, **kw) -> float`` for ``name``.

    A user function is named ``pkg.module.fn`` or ``pkg.module:fn``.
    """
    if name in BUILTIN_REWARDS:
        mod, attr = BUILTIN_REWARDS[name]
        return getattr(importlib.import_module(mod), attr)
    if ":" in name:
        mod, _, attr = name.partition(":")
    elif "." in name:
        mod, _, attr = name.rpartition(".")
    else:
        raise ConfigError(config_path, f"unknown reward {name!r}",
                          f"use one of {', '.join(BUILTIN_REWARDS)} or an import path like my_pkg.rewards.fn")
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
