"""A reward of one's own for GSM8K-style math: the right number, a format bonus and a length penalty.

``@register_reward`` adds the name ``concise_math`` to the reward registry when this module is imported;
``plugins: [my_reward]`` in the experiment imports it in every process of the run (the CLI first, so
``areal validate-config`` already knows the name). A reward function is called as
``fn(prompt, completion, answer, **kw)``: ``prompt`` is the user text, ``completion`` the generated
text (special tokens dropped), ``answer`` the reference from the dataset (the number after ``####``).
"""

from __future__ import annotations

import re

from areal_cli.rewards.builtin import numbers_match
from areal_cli.rewards.extract import final_value, parse_exact, reference_answer
from areal_cli.rewards.outcome import Reward
from areal_cli.rewards.registry import register_reward

FORMAT_BONUS = 0.1  # for ending with a GSM8K-style "#### <number>" line
LENGTH_PENALTY = 0.05  # what a solution of LENGTH_CAP characters or more loses
LENGTH_CAP = 2000  # characters; Qwen2.5 writes GSM8K solutions of a few hundred

_FINAL_LINE = re.compile(r"####\s*\$?-?[\d,]*\.?\d+\s*$")


@register_reward("concise_math", in_process=True)  # cheap and cannot hang: no reward-pool worker needed
def concise_math(prompt: str, completion: str, answer: str, **kw) -> Reward:
    """1 for the right final number, +FORMAT_BONUS for a final "#### n" line, minus a length cost.

    The length cost grows linearly up to LENGTH_PENALTY and is kept below the format bonus: within a
    GRPO group it ranks a short right answer above a long right one, but it never pays the model to
    stop early instead of answering in the asked format. ``Reward(value, correct)`` keeps correctness
    apart from the shaped value, so ``reward/accuracy`` and ``eval/pass@1`` count right answers only.
    """
    correct = numbers_match(final_value(completion), parse_exact(reference_answer(answer)))
    formatted = _FINAL_LINE.search(completion.strip()) is not None
    length_cost = LENGTH_PENALTY * min(len(completion), LENGTH_CAP) / LENGTH_CAP
    return Reward(float(correct) + FORMAT_BONUS * formatted - length_cost, correct)
