"""`areal train` with `workflow.reward=judge`: real runs (hf server, torchrun trainer, rollout worker).

Default suite: the run's own hf server judges with the built-in verdict prompt. The tiny random model
answers garbage, so every judge call is unparseable and zeroed — counted per step in metrics.jsonl,
sampled into judge.jsonl, and the run completes. Slow: a deterministic judge at a URL
(tests/support/judge_server.py) whose verdicts parse, and a dead judge under on_failure=drop, which
must stop the run with the judge named rather than wait for ever for a full batch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from judge_server import JudgeServer
from train_runs import _env, _overrides, _records

# real runs with a judge: CI's runs phase (pytest -m runs tests/integration), not the default suite
pytestmark = [pytest.mark.timeout(400), pytest.mark.runs]

SHORT = {"trainer.total_steps": 2, "trainer.recover_every": 0, "trainer.save_every": 0, "trainer.eval_every": 0,
         "dataset.test_size": 4, "workflow.reward": "judge"}
COUNTERS = ["judge/calls", "judge/ok", "judge/failures", "judge/zeroed", "judge/dropped", "judge/retries",
            *(f"judge/failures/{k}" for k in ("timeout", "unreachable", "error", "unparseable"))]


def _train(tmp_path, model_dir, **extra) -> subprocess.CompletedProcess:
    args = _overrides(tmp_path, model_dir, **{**SHORT, **extra})
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], capture_output=True,
                          text=True, env=_env(), timeout=380)


def _judge_lines(run_dir) -> list[dict]:
    p = run_dir / "judge.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def test_train_with_the_rollout_server_as_judge(tmp_path, tiny_model_dir):
    res = _train(tmp_path, tiny_model_dir)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    run_dir = tmp_path / "runs" / "itest" / "t0"
    steps = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(k in r for k in COUNTERS), sorted(k for k in r if k.startswith("judge"))
        assert r["judge/calls"] == r["judge/ok"] + r["judge/failures"]
        assert r["judge/failures"] == r["judge/zeroed"]  # on_failure=zero: each failed sample is zeroed
        assert r["judge/failures/timeout"] == r["judge/failures/unreachable"] == r["judge/failures/error"] == 0
    calls = sum(r["judge/calls"] for r in steps)
    assert calls >= 2 * 2 * 2  # every sample of both steps' batches (2 groups of 2) was judged
    # Garbage in, garbage out: the tiny model's verdicts are unparseable, so its rewards are zeros.
    assert sum(r["judge/failures/unparseable"] for r in steps) > 0
    samples = _judge_lines(run_dir)
    assert samples and {s["step"] for s in samples} <= {1, 2}
    for s in samples:
        assert s["outcome"] in ("scored", "zero") and s["question"] and "judge_answer" in s
        if s["outcome"] == "zero":
            assert s["failure"].startswith("unparseable")


@pytest.fixture(scope="module")
def judge_server():
    srv = JudgeServer()
    yield srv
    srv.close()


def test_train_with_a_judge_at_a_url(tmp_path, tiny_model_dir, judge_server):
    res = _train(tmp_path, tiny_model_dir, **{"workflow.judge.server": "url",
                                               "workflow.judge.base_url": judge_server.url("parity")})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    run_dir = tmp_path / "runs" / "itest" / "t0"
    steps = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert sum(r["judge/ok"] for r in steps) >= 8 and all(r["judge/failures"] == 0 for r in steps)
    scored = [r for r in steps if r["judge/ok"]]
    assert all(0.0 <= r["judge/mean_score"] <= 1.0 for r in scored)
    assert judge_server.requests["parity"] >= 8
    assert {s["outcome"] for s in _judge_lines(run_dir)} == {"scored"}


def test_a_dead_judge_under_drop_stops_the_run(tmp_path, tiny_model_dir, judge_server):
    res = _train(tmp_path, tiny_model_dir, **{"workflow.judge.server": "url",
                                               "workflow.judge.base_url": judge_server.url("words"),
                                               "workflow.judge.on_failure": "drop",
                                               "workflow.judge.max_failures_in_row": 6})
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-4000:]
    assert "the LLM judge failed 6 calls in a row" in out and "max_failures_in_row" in out, out[-4000:]
