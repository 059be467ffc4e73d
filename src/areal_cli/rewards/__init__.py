"""Reward functions and their asynchronous, time-bounded runner.

``get_reward_fn(name)`` → ``fn(prompt, completion, answer, **kw) -> float`` (built-ins return a
:class:`Reward`, a float that also says whether the answer was correct) for ``numeric``,
``exact``, ``math`` (math-verify), ``code`` (sandboxed execution) or a dotted import path.
``AsyncRewardRunner(fn, max_workers, timeout_s)`` runs them in spawned worker processes.
"""

from __future__ import annotations

from areal_cli.rewards.outcome import Reward, correctness
from areal_cli.rewards.registry import BUILTIN_REWARDS, get_reward_fn
from areal_cli.rewards.runner import AsyncRewardRunner, RewardStats

__all__ = ["AsyncRewardRunner", "BUILTIN_REWARDS", "Reward", "RewardStats", "correctness", "get_reward_fn"]
