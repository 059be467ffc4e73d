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


# --- item 1: the code reward --------------------------------------------------------------------

import json  # noqa: E402

from areal_cli.rewards.code import code_reward, parse_tests  # noqa: E402

CASES = [("2\n", "4\n"), ("5\n", "10\n"), ("-3\n", "-6\n")]
FORMATS = {
    "inputs/outputs": json.dumps({"inputs": [i for i, _ in CASES], "outputs": [o for _, o in CASES]}),
    "list of input/output pairs": json.dumps([{"input": i, "output": o} for i, o in CASES]),
    "assert tests": "".join(f"assert double({i.strip()}) == {o.strip()}\n" for i, o in CASES),
}
# A correct solution in every format: stdin programs for the I/O formats, a function for asserts.
SOLUTION = ("```python\ndef double(x):\n    return 2 * x\n\nif __name__ == '__main__':\n"
            "    import sys\n    data = sys.stdin.read().split()\n    if data:\n"
            "        print(double(int(data[0])))\n```")
WRONG = SOLUTION.replace("2 * x", "x + 2")  # right on the first case only


def fence(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


# Answers from the tests' text (``text``) instead of solving: I/O pairs or the asserts' values.
LOOKUP = """import json, re, sys
try:
    spec = json.loads(text)
except ValueError:
    spec = None
pairs = {}
if isinstance(spec, dict):
    pairs = dict(zip(spec['inputs'], spec['outputs']))
elif isinstance(spec, list):
    pairs = {c['input']: c['output'] for c in spec}
table = {int(a): int(b) for a, b in re.findall(r'double\\((-?\\d+)\\) == (-?\\d+)', text)}
def double(x):
    return table[x]
if pairs:
    print(pairs[sys.stdin.read()], end='')
"""


def adversarial(tests_path: str) -> dict[str, str]:
    """Completions that try to score without solving the task (issue 22, item 1)."""
    return {
        "empty": "",
        "only prose": "I am not sure how to solve this.",
        "unparseable": fence("def double(x:\n    return"),
        "prints the expected outputs": fence("print(4)\nprint(10)\nprint(-6)"),
        "prints the first expected output": fence("print(4)"),
        "exit(0) early": fence("exit(0)\ndef double(x):\n    return 0"),
        "sys.exit(0) early": fence("import sys\nsys.exit(0)"),
        "os._exit(0) early": fence("import os\nos._exit(0)"),
        "wrong, then exit 0 from an excepthook": fence(
            "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\ndef double(x):\n    return x + 2\n"
            "print(double(int(input())))"),
        "wrong, then exit 0 from atexit": fence(
            "import atexit, os\natexit.register(lambda: os._exit(0))\ndef double(x):\n    return x + 2\n"
            "print(double(int(input())))"),
        "monkeypatches print": fence(
            "import builtins\n_p = builtins.print\nbuiltins.print = lambda *a, **k: _p('4')\n"
            "def double(x):\n    return 4\nprint(1)"),
        "monkeypatches sys.exit": fence(
            "import sys\nsys.exit = lambda *a: None\ndef double(x):\n    return x + 2\nsys.exit(1)\n"
            "print(double(int(input())))"),
        "reads the tests from disk": fence(f"text = open({tests_path!r}).read()\n" + LOOKUP),
        "reads the tests through a subprocess": fence(
            f"import subprocess\ntext = subprocess.run(['cat', {tests_path!r}], capture_output=True, "
            "text=True).stdout\n" + LOOKUP),
        "sleeps past the timeout": fence("import time\ntime.sleep(30)\ndef double(x):\n    return 2 * x"),
        "right answer, then sleeps past the timeout": SOLUTION.replace(
            "```\n", "").rstrip("`") + "\nimport time\ntime.sleep(30)\n```",
    }


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_code_reward_formats_score_right_and_wrong(fmt):
    assert code_reward("q", SOLUTION, FORMATS[fmt]) == 1.0
    assert code_reward("q", WRONG, FORMATS[fmt]) == 0.0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_adversarial_completions_never_score(fmt, tmp_path):
    """Every adversarial completion, against every format, scores 0 (the list-of-pairs format used
    to run as "test code": a list literal always runs, so an empty completion scored 1.0)."""
    tests_path = tmp_path / "dataset_tests.txt"  # where a dataset's tests could sit on disk
    tests_path.write_text(FORMATS[fmt])
    scored = {name: code_reward("q", c, FORMATS[fmt], timeout_s=2.0)
              for name, c in adversarial(str(tests_path)).items()}
    assert all(v == 0.0 for v in scored.values()), {k: v for k, v in scored.items() if v}


@pytest.mark.parametrize("reference", [
    "[1, 2, 3]", "[]", '[{"input": "1"}]', '{"inputs": ["1"]}', '{"inputs": [], "outputs": []}',
    '{"inputs": ["1", "2"], "outputs": ["1"]}', '"assert True"', "42", "null",
    "print('no assert in these tests')", "def broken(:", "", '{"inputs": [["a"]], "outputs": ["b"]}',
])
def test_unrecognised_references_are_errors_not_passes(reference):
    with pytest.raises(ValueError):
        parse_tests(reference)
    with pytest.raises(ValueError):
        code_reward("q", SOLUTION, reference)


def test_reference_errors_are_counted_in_the_reward_stats():
    import asyncio

    from areal_cli.rewards import AsyncRewardRunner

    with AsyncRewardRunner("code", max_workers=1, timeout_s=60) as runner:
        got = asyncio.run(runner("q", "", "[1, 2, 3]"))
        assert got == 0.0 and runner.stats.error == 1 and runner.stats.ok == 0
