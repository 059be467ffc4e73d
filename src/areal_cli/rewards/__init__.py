"""Reward functions and their asynchronous, time-bounded runner.

``get_reward_fn(name)`` → ``fn(prompt, completion, answer, **kw) -> float`` (built-ins return a
:class:`Reward`, a float that also says whether the answer was correct) for ``numeric``,
``exact``, ``math`` (math-verify), ``code`` (sandboxed execution), a registered plugin or a dotted
import path. ``AsyncRewardRunner(fn, max_workers, timeout_s)`` runs them in spawned worker processes.
``JudgeReward(workflow.judge, addresses)`` is the LLM judge (``workflow.reward=judge``, docs/rewards.md).

Names load lazily (PEP 562) so the validator can read :mod:`.registry` without the runner's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncRewardRunner": "areal_cli.rewards.runner", "RewardStats": "areal_cli.rewards.runner",
    "Reward": "areal_cli.rewards.outcome", "correctness": "areal_cli.rewards.outcome",
    "REWARDS": "areal_cli.rewards.registry", "get_reward_fn": "areal_cli.rewards.registry",
    "register_reward": "areal_cli.rewards.registry", "JudgeReward": "areal_cli.rewards.judge",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["REWARDS", "AsyncRewardRunner", "JudgeReward", "Reward", "RewardStats", "correctness", "get_reward_fn",
           "register_reward"]
