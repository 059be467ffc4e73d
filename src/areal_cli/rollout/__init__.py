"""Asynchronous rollout: the staleness-bounded executor and the workflows it runs (docs/rollout.md).

Names load lazily (PEP 562): the validator imports :mod:`.workflows` for the workflow registry
and must not pay for the executor's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RolloutError": "executor", "RolloutExecutor": "executor", "RolloutQueueFull": "executor",
    "staleness_stats": "executor", "has_reward_variance": "filters", "RolloutStat": "staleness",
    "StalenessManager": "staleness", "VersionCounter": "staleness", "VersionProvider": "staleness",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"areal_cli.rollout.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RolloutError", "RolloutExecutor", "RolloutQueueFull", "RolloutStat", "StalenessManager",
           "VersionCounter", "VersionProvider", "has_reward_variance", "staleness_stats"]
