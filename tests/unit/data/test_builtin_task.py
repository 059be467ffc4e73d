"""The built-in arithmetic task family: determinism, split hygiene, answers that check out."""

from __future__ import annotations

import re

import pytest

from areal_cli.data import builtin
from areal_cli.errors import ConfigError


def _eval_equations(answer: str) -> int:
    """Re-evaluate every worked step and return the final number after ####."""
    body, final = answer.rsplit("####", 1)
    for line in body.strip().splitlines():
        lhs, rhs = line.split("=")
        m = re.fullmatch(r"(\d+)([+\-*])(\d+)", lhs)
        assert m, line
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert {"+": a + b, "-": a - b, "*": a * b}[op] == int(rhs), line
    return int(final.strip())


@pytest.mark.parametrize("task", builtin.task_names())
def test_answers_are_correct_and_match_ground_truth(task):
    train, test = builtin.generate_splits(task, train_size=400, test_size=100, seed=3)
    for row in train + test:
        assert _eval_equations(row["answer"]) == int(row["ground_truth"])
        nums = [int(x) for x in re.findall(r"\d+", row["question"])]
        assert nums, row
        assert int(row["ground_truth"]) >= 0


def test_deterministic_and_seed_dependent():
    a = builtin.generate_splits("arith", 300, 50, seed=5)
    b = builtin.generate_splits("arith", 300, 50, seed=5)
    c = builtin.generate_splits("arith", 300, 50, seed=6)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]
    # A pinned fingerprint: the default task must not silently change under users' cached models
    # and published numbers (docs/embedded_default.md). Change it only together with those.
    first = builtin.generate_split("arith", "train", 2, seed=0)
    assert first[0]["question"] == "Leo has 8 balls and gives 7 to Dan. How many balls does Leo have left?"
    assert first[0]["answer"] == "8-7=1\n#### 1"
    assert first[1]["question"] == "Ivy has 11 cups and gives 9 to Leo. How many cups does Ivy have left?"


def test_test_split_is_disjoint_from_train_and_unique():
    train, test = builtin.generate_splits("arith", 5000, 300, seed=0)
    train_q = {r["question"] for r in train}
    assert not train_q & {r["question"] for r in test}
    assert len({r["question"] for r in test}) == len(test) == 300
    assert builtin.generate_split("arith", "test", 300, seed=0, train_size=5000) == test


def test_several_templates_and_ops():
    train, _ = builtin.generate_splits("arith_hard", 2000, 10, seed=0)
    ops = {r["op"] for r in train}
    assert ops == {"add", "sub", "mul", "two_step"}
    default_ops = {r["op"] for r in builtin.generate_splits("arith", 500, 10, seed=0)[0]}
    assert default_ops == {o for o, _ in builtin.TASKS["arith"].ops}


def test_unknown_task_and_impossible_size():
    with pytest.raises(ConfigError) as e:
        builtin.generate_splits("nope", 10, 10)
    assert e.value.path == "dataset.train_path" and "builtin:arith" in e.value.hint
    tiny = builtin.TaskSpec(ops=(("add", 1.0),), max_operand=2)  # only 4 distinct sums exist
    builtin.TASKS["_tiny_test"] = tiny
    try:
        names = len(builtin.NAMES) * len(builtin.ITEMS) * 4
        with pytest.raises(ConfigError):
            builtin.generate_splits("_tiny_test", 10, names + 1)
    finally:
        del builtin.TASKS["_tiny_test"]


def test_corpus_and_path_parsing():
    texts = builtin.corpus("arith", n=50)
    assert any("<|im_start|>assistant" in t for t in texts)
    assert any("*" in t for t in texts)  # every op's vocabulary is covered
    assert builtin.parse_builtin_path("builtin:arith_mix") == "arith_mix"
    assert builtin.parse_builtin_path("builtin:") == "arith"
    assert builtin.parse_builtin_path("/data/x.jsonl") is None


def test_word_steps_chains_three_operations_in_words_the_tokenizer_knows():
    """``word_steps`` (issue 44's held-out benchmark task) mixes two- and three-step problems; its words are all
    in the corpus the built-in tokenizer is trained on, so the tokenizer and the builtin models' hashes are
    unchanged by it."""
    train, _ = builtin.generate_splits("word_steps", train_size=400, test_size=50, seed=0)
    steps = {len(r["answer"].split("####")[0].strip().splitlines()) for r in train}
    assert steps == {2, 3}
    words = {w for t in builtin.corpus("arith", n=4000) for w in re.findall(r"[A-Za-z]+", t)}
    assert {w for r in train for w in re.findall(r"[A-Za-z]+", r["question"])} <= words
    assert not any(r["op"] == "three_step" for r in builtin.generate_split("arith_hard", "train", 400))
