"""The built-in agentic task learns: `areal train experiment=agent_calculator` (slow).

`pytest -m slow tests/integration/test_agent_calculator.py`. The agent is ordinary openai.AsyncOpenAI
code (areal_cli.rollout.workflows.calculator:CalculatorAgent) run through the in-process client; the
held-out success (one greedy episode per item, evaluated through the agent workflow) must rise by at
least 20 points during the RL phase, i.e. over the SFT warm start (the gain is GRPO's, not the warm
start's), and the tool-call rate is logged for training and evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _records(run_dir, kind):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def test_agent_calculator_learns(tmp_path):
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={tmp_path}",
                          "experiment=agent_calculator"], capture_output=True, text=True, env=env,
                         timeout=3500)
    wall = time.time() - t0
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (summary_path,) = (tmp_path / "runs").glob("*/*/summary.json")
    run_dir = summary_path.parent
    evals = _records(run_dir, "eval")
    base = [r for r in evals if r.get("phase") == "base"]
    before_rl = [r for r in evals if r.get("phase") == "sft"]  # after the warm start, before any RL step
    after = evals[-1]
    print(f"\nagent_calculator: wall {wall:.0f}s, held-out success: base {base[0]['eval/pass@1']:.1%}, "
          f"after the SFT warm start {before_rl[0]['eval/pass@1']:.1%}, after RL {after['eval/pass@1']:.1%}; "
          f"tool-call rate {before_rl[0]['eval/tool_call_rate']:.1%} -> {after['eval/tool_call_rate']:.1%}")
    # the RL phase itself: at least +20 points of held-out success over the warm start
    assert after["eval/pass@1"] - before_rl[0]["eval/pass@1"] >= 0.20, evals
    assert after["eval/tool_call_rate"] >= before_rl[0]["eval/tool_call_rate"], evals
    train = _records(run_dir, "train")
    assert train and all("agent/tool_call_rate" in r for r in train)
    assert all("eval/tool_call_rate" in r for r in evals)
