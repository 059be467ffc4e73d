"""What a reward function returns: a number, optionally saying whether the answer was correct.

Correctness belongs to the reward function, not to a threshold on its value: a partial-credit
reward of 0.3 may be a correct answer, a shaped reward of 0.9 a wrong one. A function says so by
returning :class:`Reward` (every built-in reward does) or a ``bool`` (True = 1.0 and correct). A
plain number leaves correctness unknown; accuracy metrics then count only the rows that know it
and are left out when none does (``reward/mean`` is always reported).

:class:`Reward` is a ``float``, so code that only wants the value (``float(r)``, ``r == 1.0``,
arithmetic) keeps working, and it pickles across the reward worker processes.
"""

from __future__ import annotations

from typing import Any

# Per-row correctness codes in a trajectory's ``correct`` tensor (int8).
CORRECT, WRONG, UNKNOWN = 1, 0, -1


class Reward(float):
    """A reward value with ``correct``: whether the reward function judged the answer correct."""

    correct: bool

    def __new__(cls, value: float, correct: bool) -> "Reward":
        obj = super().__new__(cls, value)
        obj.correct = bool(correct)
        return obj

    @classmethod
    def of(cls, correct: bool) -> "Reward":
        """1.0 and correct, or 0.0 and wrong: a binary verifier's result."""
        return cls(1.0 if correct else 0.0, correct)

    def __reduce__(self):
        return (Reward, (float(self), self.correct))

    def __repr__(self) -> str:
        return f"Reward({float(self)!r}, correct={self.correct})"


class Dropped(float):
    """A sample its reward could not score and that the run leaves out (the LLM judge's
    ``on_failure=drop``): the workflow drops the episode. NaN, so it can never pass for a score."""

    def __new__(cls) -> "Dropped":
        return super().__new__(cls, float("nan"))

    def __reduce__(self):
        return (Dropped, ())

    def __repr__(self) -> str:
        return "Dropped()"


def is_dropped(value: Any) -> bool:
    return isinstance(value, Dropped)


def correctness(value: Any) -> bool | None:
    """``Reward.correct``; a bool is its own correctness; anything else is unknown (None)."""
    if isinstance(value, Reward):
        return value.correct
    if isinstance(value, bool):
        return value
    return None


def as_outcome(value: Any) -> float:
    """A reward function's result as a float that keeps its correctness (a :class:`Reward`) when
    the function stated one."""
    if isinstance(value, Dropped):
        return value
    ok = correctness(value)
    return float(value) if ok is None else Reward(float(value), ok)


def correct_code(value: Any) -> int:
    ok = correctness(value)
    return UNKNOWN if ok is None else (CORRECT if ok else WRONG)


def correct_counts(batch: dict[str, Any]) -> tuple[float, float]:
    """(rows judged correct, rows whose correctness is known) of a batch's ``correct`` tensor; (0, 0)
    for batches from workflows that do not record it."""
    c = batch.get("correct")
    if c is None:
        return 0.0, 0.0
    return float((c == CORRECT).sum().item()), float((c != UNKNOWN).sum().item())
