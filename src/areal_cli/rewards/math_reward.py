"""Math answers through math-verify (LaTeX and plain expressions), with a numeric fallback.

math-verify's own timeouts use SIGALRM, which only works in a process's main thread; elsewhere
they are turned off and the caller's timeout (``AsyncRewardRunner``) bounds the time instead.
"""

from __future__ import annotations

import threading

from areal_cli.rewards.builtin import numeric_reward
from areal_cli.rewards.extract import extract_after_hashes, parse_number, reference_answer
from areal_cli.rewards.outcome import Reward


def _gold_text(answer: str) -> str:
    ref = reference_answer(answer)
    if extract_after_hashes(answer) is not None or "$" in ref or "\\boxed" in answer:
        return ref if "$" in ref else f"${ref}$"
    return f"${ref}$" if "\\" in ref else ref


def math_reward(prompt: str, completion: str, answer: str, **_) -> Reward:
    """1.0 if math-verify finds the completion's answer equivalent to the reference."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    t = 5 if main else None
    gold = parse(_gold_text(answer), parsing_timeout=t)
    if not gold:
        if parse_number(reference_answer(answer)) is not None:
            return numeric_reward(prompt, completion, answer)
        raise ValueError(f"math-verify could not parse the reference answer {answer!r}")
    marked = None if "\\boxed" in completion else extract_after_hashes(completion)
    pred = parse(marked if marked else completion, parsing_timeout=t)
    if not pred:
        return Reward.of(False)
    return Reward.of(bool(verify(gold, pred, timeout_seconds=t)))
