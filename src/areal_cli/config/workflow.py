"""``workflow`` group: how one dataset item becomes a scored trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkflowConfig:
    # rlvr | multi_turn | a dotted import path to a RolloutWorkflow subclass
    name: str = "rlvr"
    reward: str = "numeric"  # numeric | exact | math | code | import path to a reward function
    reward_timeout_s: float = 15.0
    reward_workers: int = 2
    max_turns: int = 2  # multi_turn
    turn_discount: float = 0.9  # multi_turn
    feedback: str = "Your answer is wrong. Try again."  # multi_turn retry prompt
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra kwargs for a user workflow
