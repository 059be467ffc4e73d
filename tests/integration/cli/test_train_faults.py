"""Fault handling of a real `areal train`: a killed inference server, a killed trainer rank.

Slow (each run pays for server and trainer start-up, plus a server restart): `pytest -m slow`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from train_runs import (_descendants_alive, _hold_then_kill, _overrides, _records, _start, _wait_for,
                        assert_each_prompt_once)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_killed_server_is_restarted_and_no_prompt_is_lost_or_duplicated(tmp_path, tiny_model_dir):
    """Synchronous mode, so every consumed prompt position is known: the run must train on exactly
    positions 0..N-1, each once, although the only server was SIGKILLed mid-run."""
    steps, batch = 10, 2
    run_dir = tmp_path / "runs" / "itest" / "t0"
    # The kill lands while the paused server holds a step's requests, early in the run: 512 forced tokens
    # keep each step long enough. (With a plain kill after step 1 and short rollouts, a fast run finished
    # all 5 of its steps before the kill, and the restart was only seen by the final evaluation.)
    proc = _start(_overrides(tmp_path, tiny_model_dir, **{
        "trainer.total_steps": steps, "algo.batch_size": batch, "rollout.max_head_offpolicyness": 0,
        "trainer.recover_every": 0, "trainer.save_every": 0, "trainer.eval_every": 0,
        "rollout.gconfig.max_new_tokens": 512, "rollout.gconfig.min_new_tokens": 512}))
    _wait_for(lambda: any(r["kind"] == "train" for r in _records(run_dir)), proc, 300, "the first step")
    _hold_then_kill(run_dir, proc, 1)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "restarting" in out
    train = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert_each_prompt_once(train, steps * batch)
    restarted = [r["step"] for r in train if r["rollout/server_restarts"] >= 1]
    assert restarted and restarted[0] < steps, [r["step"] for r in train]  # noticed mid-run, not at the end
    log = (run_dir / "logs" / "server0.log").read_text()
    assert log.count("===== start server0") == 2


def test_killed_trainer_rank_stops_everything_and_names_it(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "runs" / "itest" / "t0"
    proc = _start(_overrides(tmp_path, tiny_model_dir, **{"trainer.total_steps": 50}))
    rank_log = run_dir / "logs" / "trainer_rank0.log"
    _wait_for(lambda: any(r["kind"] == "train" for r in _records(run_dir)), proc, 300, "the first step")
    children = _children(proc.pid)
    pid = int(re.search(r"trainer rank 0/\d+ pid (\d+)", rank_log.read_text()).group(1))
    servers = [json.loads(p.read_text()) for p in (run_dir / "servers").glob("*.json")]
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    assert "trainer rank 0" in out and "SIGKILL" in out, out[-3000:]
    time.sleep(0.5)
    assert _descendants_alive(children) == []
    from areal_cli.utils.network import port_is_free

    for rec in servers:
        assert port_is_free(int(rec["address"].rsplit(":", 1)[1]))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert not any(Path(run_dir / "servers").glob("*.json"))
