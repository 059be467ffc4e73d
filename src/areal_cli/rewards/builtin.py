"""Exact and numeric match rewards for built-in tasks. Signature: ``fn(prompt, completion, answer, **kw)``."""

from __future__ import annotations

from areal_cli.rewards.extract import final_answer_text, final_value, parse_exact, reference_answer
from areal_cli.rewards.outcome import Reward


def _norm(s: str) -> str:
    return " ".join(s.split()).strip().rstrip(".").strip()


def numbers_match(pred, gold, rel_tol: float = 1e-9, abs_tol: float = 1e-9) -> bool:
    """Exact rationals: an integer reference must be matched exactly (``1450001`` is not
    ``1450000``, however large); any other reference within ``rel_tol`` of its magnitude, or
    ``abs_tol`` near 0 (``0.3333333333`` matches ``1/3``, ``0.333`` does not)."""
    if pred is None or gold is None:
        return False
    if gold.denominator == 1:
        return pred == gold
    return abs(pred - gold) <= max(rel_tol * abs(gold), abs_tol)


def numeric_reward(prompt: str, completion: str, answer: str, rel_tol: float = 1e-9,
                   abs_tol: float = 1e-9, **_) -> Reward:
    """1.0 (correct) if the completion's final number equals the reference number (GSM8K ``#### n``
    refs), else 0.0; see :func:`numbers_match` for what "equals" means."""
    gold = parse_exact(reference_answer(answer))
    if gold is None:
        raise ValueError(f"reference answer {answer!r} has no number; use reward=exact or math")
    return Reward.of(numbers_match(final_value(completion), gold, rel_tol, abs_tol))


def exact_reward(prompt: str, completion: str, answer: str, **_) -> Reward:
    """1.0 if the marked final answer (or, unmarked, the whole completion) equals the reference
    after whitespace normalisation."""
    gold = _norm(reference_answer(answer))
    marked = final_answer_text(completion)
    pred = _norm(marked if marked is not None else completion)
    return Reward.of(pred == gold)
