"""``workflow`` group: how one dataset item becomes a scored trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged
from typing import Any


@dataclass
class WorkflowConfig:
    # rlvr | multi_turn | a dotted import path to a RolloutWorkflow subclass
    name: str = "rlvr"
    reward: str = "numeric"  # numeric | exact | math | code | import path to a reward function
    reward_timeout_s: float = ranged(15.0, gt=0.0)
    reward_workers: int = ranged(2, ge=1)
    max_turns: int = ranged(2, ge=1)  # multi_turn
    turn_discount: float = ranged(0.9, gt=0.0, le=1.0)  # multi_turn
    feedback: str = "Your answer is wrong. Try again."  # multi_turn retry prompt
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra kwargs for a user workflow
