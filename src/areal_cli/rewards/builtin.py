"""Exact and numeric match rewards for built-in tasks. Signature: ``fn(prompt, completion, answer, **kw)``."""

from __future__ import annotations

import math

from areal_cli.rewards.extract import final_answer_text, final_number, parse_number, reference_answer


def _norm(s: str) -> str:
    return " ".join(s.split()).strip().rstrip(".").strip()


def numeric_reward(prompt: str, completion: str, answer: str, rel_tol: float = 1e-6,
                   abs_tol: float = 1e-6, **_) -> float:
    """1.0 if the completion's final number equals the reference number (GSM8K ``#### n`` refs)."""
    gold = parse_number(reference_answer(answer))
    if gold is None:
        raise ValueError(f"reference answer {answer!r} has no number; use reward=exact or math")
    pred = final_number(completion)
    return float(pred is not None and math.isclose(pred, gold, rel_tol=rel_tol, abs_tol=abs_tol))


def exact_reward(prompt: str, completion: str, answer: str, **_) -> float:
    """1.0 if the marked final answer (or, unmarked, the whole completion) equals the reference
    after whitespace normalisation."""
    gold = _norm(reference_answer(answer))
    marked = final_answer_text(completion)
    pred = _norm(marked if marked is not None else completion)
    return float(pred == gold)
