"""Asynchronous rollout: the staleness-bounded executor and the workflows it runs (docs/rollout.md)."""

from __future__ import annotations

from areal_cli.rollout.executor import RolloutError, RolloutExecutor, RolloutQueueFull, staleness_stats
from areal_cli.rollout.filters import has_reward_variance
from areal_cli.rollout.staleness import RolloutStat, StalenessManager, VersionCounter, VersionProvider

__all__ = ["RolloutError", "RolloutExecutor", "RolloutQueueFull", "RolloutStat", "StalenessManager",
           "VersionCounter", "VersionProvider", "has_reward_variance", "staleness_stats"]
