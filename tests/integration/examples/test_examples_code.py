"""Every code-bearing example trained for two steps on CPU: `areal train --config-dir examples/<name>
experiment=<name>` through the real CLI (local launcher, hf server, torchrun trainer, rollout worker),
shrunk by the smoke override every example runs under (tests/support/example_smoke.py).

Each run must end with exit 0 and two train steps of finite loss, and must show that the example's own
code ran, in numbers the built-in parts cannot produce:
- multi_turn_math: generated tokens per row above the per-attempt limit (the model retried);
- custom_reward: a negative mean reward (its length cost);
- custom_workflow: a negative mean reward (its verdict term) and two generated turns per row;
- the agent examples (the real Agents SDK, and LangChain in processes of its own behind the real proxy):
  episodes that called the calculator tool;
- online_agent: its service.py, a process of its own started beside `areal train`, ended every session
  the run trained (the gateway's counters), and none was dropped.

The agents run on a tiny model fine-tuned to call the calculator (tests/support/example_tool_model.py),
because the random one never writes a tool call. The wall time of each run is printed (`-s`).
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import time

import pytest
from example_smoke import EXAMPLES, smoke_overrides
from example_tool_model import make_calculator_model

pytestmark = [pytest.mark.examples, pytest.mark.timeout(1200)]

MAX_NEW = 8  # the smoke override's rollout.gconfig.max_new_tokens
# The agent's own limits on the tiny model's 1024 positions: a calculator call is ~70 tokens with its
# byte-level tokenizer, and the instructions plus the tool schema take ~550.
AGENT_LIMITS = {"workflow.kwargs.default_max_tokens": 96, "workflow.kwargs.max_total_tokens": 1000}


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    for k in ("AREAL_PLUGINS", "AREAL_CONFIG_DIR"):
        env.pop(k, None)
    return env


def train_example(tmp_path, name: str, model_dir: str, **extra: object) -> list[dict]:
    """Run the example's smoke training; its train and eval records (asserted: 2 steps, finite loss)."""
    fileroot = tmp_path / "fileroot"
    overrides = smoke_overrides(fileroot, model_dir, **{"rollout.eval_gconfig.max_new_tokens": MAX_NEW,
                                                        **extra})
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", "--config-dir", str(EXAMPLES / name),
                        f"experiment={name}", *overrides], capture_output=True, text=True, env=_env(),
                       cwd=tmp_path, timeout=1100, check=False)
    print(f"\n[{name}] areal train: {time.time() - t0:.0f}s wall")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lines = (fileroot / "runs" / "smoke" / "t0" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r.get("kind") in ("train", "eval")]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2], records
    assert all(isinstance(r["train/loss"], float) and math.isfinite(r["train/loss"]) for r in train), train
    return records


def _train(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def calculator_model(tiny_model_dir, tmp_path_factory) -> str:
    t0 = time.time()
    out = make_calculator_model(tiny_model_dir, str(tmp_path_factory.mktemp("calculator_model")))
    print(f"\n[calculator model] {time.time() - t0:.0f}s (fine-tune, or a copy from the cache)")
    return out


def test_multi_turn_math(tmp_path, tiny_model_dir):
    train = _train(train_example(tmp_path, "multi_turn_math", tiny_model_dir))
    # the untrained model is always wrong, so every dialogue retries: more tokens than one attempt may have
    assert all(r["gen/mean_len"] > MAX_NEW for r in train), train
    assert all(r["reward/accuracy"] == 0.0 for r in train), train


def _constant(path, name: str):
    """A module-level constant of an example, read without importing it (the import would register the
    example's reward in this test process too)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} defines no {name}")


def test_custom_reward(tmp_path, tiny_model_dir):
    length_penalty = _constant(EXAMPLES / "custom_reward" / "my_reward.py", "LENGTH_PENALTY")
    records = train_example(tmp_path, "custom_reward", tiny_model_dir)
    # never right, never formatted: the length cost alone, which the built-in rewards (>= 0) cannot give
    for r in _train(records):
        assert -length_penalty - 1e-6 <= r["reward/mean"] < 0, r  # float32 rewards
    assert all(r["eval/reward_mean"] < 0 for r in records if r["kind"] == "eval"), records


def test_custom_workflow(tmp_path, tiny_model_dir):
    records = train_example(tmp_path, "custom_workflow", tiny_model_dir)
    for r in _train(records):
        # no right answer and no readable verdict: -verdict_bonus (0.2) on every row
        assert -0.2 - 1e-6 <= r["reward/mean"] < 0, r  # float32 rewards
        # the answer and the verdict are both generated and trained: more than one turn's limit per row
        assert r["gen/mean_len"] > MAX_NEW, r


def test_agents_sdk_tool(tmp_path, calculator_model):
    records = train_example(tmp_path, "agents_sdk_tool", calculator_model, **AGENT_LIMITS)
    train = _train(records)
    rates = [r["agent/tool_call_rate"] for r in train]
    print(f"[agents_sdk_tool] tool-call rate per step {rates}, reward {[r['reward/mean'] for r in train]}")
    assert max(rates) > 0, train  # the SDK ran the model's calculator calls, and the episodes were kept
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and all("eval/tool_call_rate" in r for r in evals), evals  # evaluated through the agent


def test_langchain_proxy(tmp_path, calculator_model):
    # the interpreter running the tests, not whichever `python` comes first on PATH
    command = f"{sys.executable} -m lc_agent"
    records = train_example(tmp_path, "langchain_proxy", calculator_model, **AGENT_LIMITS,
                            **{"workflow.kwargs.command": command})
    train = _train(records)
    rates = [r["agent/tool_call_rate"] for r in train]
    print(f"[langchain_proxy] tool-call rate per step {rates}, reward {[r['reward/mean'] for r in train]}")
    assert max(rates) > 0, train  # LangChain's processes called the tool through the proxy


def test_online_agent(tmp_path, tiny_model_dir):
    """The trainer and the example's service as two processes, as the README runs them: the service finds
    the gateway through the run dir and ends sessions until the run is over."""
    gateway = tmp_path / "fileroot" / "runs" / "smoke" / "t0" / "gateway.json"
    svc = subprocess.Popen([sys.executable, str(EXAMPLES / "online_agent" / "service.py"), "--gateway-file",
                            str(gateway), "--workers", "2", "--max-tokens", "8", "--give-up-s", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        records = train_example(tmp_path, "online_agent", tiny_model_dir, **{
            "rollout.group_size": 1, "workflow.kwargs.default_max_tokens": 16,
            "workflow.kwargs.max_total_tokens": 400})
        out, _ = svc.communicate(timeout=120)  # it stops once the gateway has been gone for 5 s
    finally:
        if svc.poll() is None:
            svc.kill()
    assert svc.returncode == 0, out[-3000:]
    train = _train(records)
    ended = [r["online/ended"] for r in train]
    print(f"[online_agent] sessions ended by step {ended}; service: {out.strip().splitlines()[-1]}")
    # 2 sessions trained per step, every one of them ended by the service, none abandoned
    assert ended[-1] >= 4 and all(r["online/abandoned"] == 0 for r in train), train
    assert int(out.strip().splitlines()[-1].split()[0]) >= ended[-1], out[-3000:]
    assert not gateway.exists()  # removed when the run's gateway stopped
