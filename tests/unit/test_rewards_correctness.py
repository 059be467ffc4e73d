"""Issue 22, rewards: exact integer comparison in ``numeric``; the code reward's formats and
adversarial completions; correctness returned by the reward function."""

from __future__ import annotations

import pytest

from areal_cli.rewards import get_reward_fn


@pytest.mark.parametrize("completion,answer,expect", [
    ("#### 1450001", "#### 1450000", 0.0),  # rel_tol=1e-6 used to call N+1 correct for large N
    ("#### 1450000", "#### 1450000", 1.0),
    ("#### 1,450,000.0", "#### 1450000", 1.0),  # the same integer, written differently
    ("#### 1450000.5", "#### 1450000", 0.0),
    ("#### 123456789012345678901", "123456789012345678900", 0.0),  # beyond float precision
    ("#### 123456789012345678900", "123456789012345678900", 1.0),
    ("#### 1000000001", "1000000000", 0.0),
    ("#### 0.3333333333", r"\frac{1}{3}", 1.0),  # decimals: relative tolerance 1e-9
    ("#### 0.333", r"\frac{1}{3}", 0.0),
    ("#### 2.5", "2.5", 1.0),
    ("#### 2.5000001", "2.5", 0.0),
    ("#### -7", "-7", 1.0),
    ("#### 7", "-7", 0.0),
])
def test_numeric_integers_compare_exactly(completion, answer, expect):
    assert get_reward_fn("numeric")("q", completion, answer) == expect
