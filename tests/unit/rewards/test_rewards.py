"""Reward functions: answer extraction, numeric/exact/math match, user import paths."""

from __future__ import annotations

import pytest

from areal_cli.errors import ConfigError
from areal_cli.rewards import get_reward_fn
from areal_cli.rewards.extract import (extract_boxed, final_answer_text, final_number, parse_number,
                                         reference_answer)

GSM_REF = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"


def test_extraction_helpers():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}+1}") == "x^{2}+1"
    assert extract_boxed("no box") is None
    assert reference_answer(GSM_REF) == "72"
    assert reference_answer(r"\boxed{3}") == "3"
    assert reference_answer(" 5 ") == "5"
    assert parse_number("1,234") == 1234
    assert parse_number("$-3.5") == -3.5
    assert parse_number(r"\frac{3}{4}") == 0.75
    assert parse_number("3/4") == 0.75
    assert parse_number("50%") == 50
    assert parse_number("abc") is None
    assert final_number("First 3 then 4, so the answer is 12.") == 12
    assert final_number("blah 7 #### 1,000") == 1000
    assert final_number(r"we get \boxed{-2}") == -2
    assert final_number("nothing") is None


@pytest.mark.parametrize("completion,answer,expect", [
    ("She sold 72 clips.", GSM_REF, 1.0),
    ("48+24=72\n#### 72", GSM_REF, 1.0),
    ("48+24=72\n#### 73", GSM_REF, 0.0),  # the marked answer wins over the last number
    (r"The total is \boxed{72}", "72", 1.0),
    ("about 71.9", "72", 0.0),
    ("1,000 apples", "#### 1000", 1.0),
    ("no number here", "5", 0.0),
])
def test_numeric_reward(completion, answer, expect):
    assert get_reward_fn("numeric")("q", completion, answer) == expect


def test_numeric_reward_rejects_non_numeric_reference():
    with pytest.raises(ValueError, match="no number"):
        get_reward_fn("numeric")("q", "42", "forty-two")


@pytest.mark.parametrize("completion,answer,expect", [
    ("Paris", "Paris", 1.0),
    ("  Paris.  ", "Paris", 1.0),
    ("The answer is Paris", "Paris", 1.0),
    (r"\boxed{Paris}", "Paris", 1.0),
    ("paris", "Paris", 0.0),
    ("Lyon", "#### Paris", 0.0),
])
def test_exact_reward(completion, answer, expect):
    assert get_reward_fn("exact")("q", completion, answer) == expect


@pytest.mark.parametrize("completion,answer,expect", [
    (r"Hence $\frac{1}{2}$.", "0.5", 1.0),  # LaTeX parsing (antlr4 4.9.3 runtime)
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),
    (r"so $2\sqrt{2}$", r"\boxed{\sqrt{8}}", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    ("48+24=72\n#### 72", GSM_REF, 1.0),
    ("48+24=72\n#### 70", GSM_REF, 0.0),
    ("The result is 1,234", "1234", 1.0),
    ("I don't know", GSM_REF, 0.0),
])
def test_math_reward(completion, answer, expect):
    assert get_reward_fn("math")("q", completion, answer) == expect


def test_user_reward_by_import_path():
    fn = get_reward_fn("areal_cli.rewards.builtin.numeric_reward")
    assert fn("q", "7", "7") == 1.0
    assert get_reward_fn("areal_cli.rewards.builtin:exact_reward")("q", "a", "a") == 1.0
    with pytest.raises(ConfigError, match="workflow.reward"):
        get_reward_fn("nonexistent_pkg_xyz.fn")
    with pytest.raises(ConfigError, match="unknown reward"):
        get_reward_fn("fuzzy")
    with pytest.raises(ConfigError, match="no callable"):
        get_reward_fn("areal_cli.rewards.builtin.nothing_here")


# `.` in a regex matches these, while str.strip()/splitlines() treat them as whitespace or line breaks: a sampled
# "answer:\x0c" once crashed a whole run with IndexError inside final_answer_text.
ODD_BREAKS = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("name", ["numeric", "exact", "math"])
@pytest.mark.parametrize("sep", ODD_BREAKS)
def test_rewards_survive_odd_line_breaks(name, sep):
    fn = get_reward_fn(name)
    for completion in (f"the answer is{sep}", f"answer:{sep}  {sep}", f"#### {sep}", f"Answer ={sep}72"):
        assert fn("q", completion, "72") in (0.0, 1.0)
    assert final_answer_text(f"so the answer is {sep}") is None
    assert final_answer_text(f"the answer is 5{sep}6") == "5"
