"""The built-in task family: arithmetic word problems, generated deterministically.

``generate_split("arith", "train", n, seed)`` returns GSM8K-shaped rows::

    {"question": "Tom has 17 apples and buys 25 more. How many apples does Tom have now?",
     "answer": "17+25=42\\n#### 42", "ground_truth": "42", "op": "add", "id": "arith-train-0"}

Train and test splits come from independent RNG streams and the test split excludes every
question that appears in train, so held-out accuracy measures generalisation, not recall.
The same ``(task, split, n, seed)`` always yields the same rows on any machine (``random.Random``
is stable across platforms and Python versions for ``randint``/``choice``).

The default ``arith`` mix is tuned so a ~1M-parameter model learns it partially with a short
SFT warm start and GRPO keeps improving it (docs/embedded_default.md has the numbers).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from areal_cli.errors import ConfigError

NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Eva", "Max", "Zoe", "Ben", "Ivy", "Dan", "Amy"]
ITEMS = ["apples", "pens", "books", "cards", "coins", "eggs", "balls", "cups", "stones", "shells"]

# Offsets that keep the train and test RNG streams apart for the same user seed.
_SPLIT_SALT = {"train": 0x5EED_0001, "test": 0x5EED_0002}


@dataclass(frozen=True)
class Problem:
    question: str
    equation: str  # worked step(s) without the final marker, e.g. "17+25=42"
    result: int
    op: str


def _add(rng: random.Random, hi: int) -> Problem:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
    return Problem(q, f"{a}+{b}={a + b}", a + b, "add")


def _sub(rng: random.Random, hi: int) -> Problem:
    a, b = sorted((rng.randint(1, hi), rng.randint(1, hi)), reverse=True)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    q = f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?"
    return Problem(q, f"{a}-{b}={a - b}", a - b, "sub")


def _mul(rng: random.Random, hi: int) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, max(2, min(hi, 12)))
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"
    return Problem(q, f"{a}*{b}={a * b}", a * b, "mul")


def _two_step(rng: random.Random, hi: int) -> Problem:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    c = rng.randint(1, a + b)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    q = (f"{name} has {a} {item}, finds {b} more and then loses {c}. "
         f"How many {item} does {name} have now?")
    return Problem(q, f"{a}+{b}={a + b}\n{a + b}-{c}={a + b - c}", a + b - c, "two_step")


def _three_step(rng: random.Random, hi: int) -> Problem:
    """Buy boxes, add to what one has, give some away: a product, a sum and a difference chained, in the
    words the other problems use (so the built-in tokenizer covers it without being retrained)."""
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, hi)
    d = rng.randint(1, a * b + c)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    q = (f"{name} has {c} {item}, buys {a} boxes with {b} {item} in each box and gives {d} to {other}. "
         f"How many {item} does {name} have left?")
    return Problem(q, f"{a}*{b}={a * b}\n{a * b}+{c}={a * b + c}\n{a * b + c}-{d}={a * b + c - d}",
                   a * b + c - d, "three_step")


OPS: dict[str, Callable[[random.Random, int], Problem]] = {
    "add": _add, "sub": _sub, "mul": _mul, "two_step": _two_step, "three_step": _three_step,
}
# The ops whose words trained the built-in tokenizer (``corpus``); a new op must reuse their words, so the
# tokenizer, and every builtin model's hash, stay what they are.
_CORPUS_OPS = ("add", "sub", "mul", "two_step")


@dataclass(frozen=True)
class TaskSpec:
    """A member of the task family: which operations (with weights) and the operand range."""

    ops: tuple[tuple[str, float], ...]
    max_operand: int


TASKS: dict[str, TaskSpec] = {
    # The embedded default: one-step add/sub problems, operands 1..20 (see docs/embedded_default.md).
    "arith": TaskSpec(ops=(("add", 1.0), ("sub", 1.0)), max_operand=20),
    "arith_easy": TaskSpec(ops=(("add", 1.0),), max_operand=10),
    "arith_mix": TaskSpec(ops=(("add", 1.0), ("sub", 1.0), ("mul", 1.0)), max_operand=50),
    "arith_hard": TaskSpec(ops=(("add", 1.0), ("sub", 1.0), ("mul", 1.0), ("two_step", 1.0)),
                           max_operand=99),
    # Multi-step problems of another shape (three chained operations, a longer worked answer): the task
    # benchmarks/vs_trl.py --task keeps out of tuning (issue 44).
    "word_steps": TaskSpec(ops=(("two_step", 1.0), ("three_step", 1.0)), max_operand=20),
}


def task_names() -> list[str]:
    return sorted(TASKS)


def registry_spec(registry: dict, task: str, what: str = "built-in task"):
    """``registry[task]``, or the one-line error naming every ``builtin:`` choice (text and visual tasks)."""
    if task not in registry:
        raise ConfigError("dataset.train_path", f"unknown {what} {task!r}",
                          f"use one of: {', '.join('builtin:' + t for t in sorted(registry))}")
    return registry[task]


def _spec(task: str) -> TaskSpec:
    return registry_spec(TASKS, task)


def make_problem(rng: random.Random, spec: TaskSpec) -> Problem:
    names = [o for o, _ in spec.ops]
    weights = [w for _, w in spec.ops]
    op = rng.choices(names, weights=weights, k=1)[0]
    return OPS[op](rng, spec.max_operand)


def to_row(p: Problem, task: str, split: str, idx: int) -> dict:
    return {
        "id": f"{task}-{split}-{idx}",
        "question": p.question,
        "answer": f"{p.equation}\n#### {p.result}",
        "ground_truth": str(p.result),
        "op": p.op,
    }


def _draw(task: str, split: str, n: int, seed: int, exclude: set[str]) -> list[dict]:
    spec = _spec(task)
    rng = random.Random(seed * 1_000_003 + _SPLIT_SALT[split])
    rows: list[dict] = []
    seen: set[str] = set()
    tries = 0
    # The question space is large (~10^5 for "arith"), so rejection rarely triggers; the bound
    # only stops an impossible request (n larger than the space) from looping forever.
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ConfigError("dataset.train_size", f"built-in task {task!r} cannot produce {n} "
                              f"distinct {split} questions", "lower dataset.train_size/test_size")
        p = make_problem(rng, spec)
        if p.question in exclude or (split == "test" and p.question in seen):
            continue
        seen.add(p.question)
        rows.append(to_row(p, task, split, len(rows)))
    return rows


def generate_splits(task: str = "arith", train_size: int = 20000, test_size: int = 200,
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Both splits; test questions never occur in train (train may repeat questions)."""
    train = _draw(task, "train", train_size, seed, exclude=set())
    test = _draw(task, "test", test_size, seed, exclude={r["question"] for r in train})
    return train, test


def generate_split(task: str, split: str, n: int, seed: int = 0, *,
                   train_size: int | None = None) -> list[dict]:
    """One split. For ``test``, ``train_size`` (default: ``n`` of train = 20000) sets the exclusion set."""
    if split not in _SPLIT_SALT:
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    if split == "train":
        return _draw(task, "train", n, seed, exclude=set())
    train = _draw(task, "train", train_size if train_size is not None else 20000, seed, exclude=set())
    return _draw(task, "test", n, seed, exclude={r["question"] for r in train})


def corpus(task: str = "arith", n: int = 4000, seed: int = 0) -> list[str]:
    """Chat-formatted text for training the built-in tokenizer on this task's vocabulary."""
    rows = _draw(task, "train", n, seed + 7, exclude=set())
    # Every op's words are included so one tokenizer serves the whole family.
    extra_rng = random.Random(seed + 11)
    extra = [OPS[op](extra_rng, 99) for op in _CORPUS_OPS for _ in range(200)]
    texts = [f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n{r['answer']}<|im_end|>\n"
             for r in rows]
    texts += [f"{p.question}\n{p.equation}\n#### {p.result}" for p in extra]
    texts.append("The answer is . , ; : ! ? ( ) [ ] { } + - * / = # \\boxed{} system user assistant")
    return texts


def parse_builtin_path(path: str) -> str | None:
    """``"builtin:arith"`` → ``"arith"``; any other string → ``None``."""
    if isinstance(path, str) and path.startswith("builtin:"):
        return path.split(":", 1)[1] or "arith"
    return None
