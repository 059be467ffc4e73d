"""Running `areal train` from tests: the override set of a short run on the tiny model, the environment,
the run's metrics records, waiting on a condition while the run lives, and leftover processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _overrides(fileroot: Path, model_dir: str, **extra: object) -> list[str]:
    base = {
        "cluster.fileroot": str(fileroot), "model.path": model_dir, "experiment_name": "itest",
        "trial_name": "t0", "trainer.total_steps": 6, "trainer.sft_warmup_steps": 0,
        "trainer.recover_every": 2, "trainer.save_every": 2, "trainer.eval_every": 3,
        "algo.batch_size": 2, "rollout.group_size": 2, "rollout.gconfig.max_new_tokens": 6,
        "rollout.max_head_offpolicyness": 1, "rollout.max_concurrent_rollouts": 8,
        "dataset.train_size": 200, "dataset.test_size": 8, "dataset.max_prompt_len": 256,
        "stats.live": "false", "algo.optim.lr": 1e-3,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    return env


def _areal(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "areal_cli.cli.main", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True, **kw)


def _records(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _descendants_alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _start(args: list[str]) -> subprocess.Popen:
    return _areal(args)


def _wait_for(cond, proc: subprocess.Popen, timeout: float, what: str, interval: float = 0.3) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"areal train ended before {what}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


# The random tiny model never solves arithmetic, so the rewards would all be 0 and nothing would
# train; this reward varies with the completion so every step really updates the weights.
REWARD = """
def varied_reward(prompt, completion, answer, **kw):
    return float(len(completion) % 3) / 2.0
"""


def _env_with_reward(tmp_path) -> dict[str, str]:
    (tmp_path / "resume_reward.py").write_text(REWARD)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


def assert_each_prompt_once(train: list[dict], n_prompts: int) -> None:
    """Synchronous runs log every step's prompt positions: each of 0..n_prompts-1 trained on exactly once
    (none lost, none duplicated, e.g. across a server restart)."""
    positions = [p for r in train for p in r["data/positions"]]
    assert len(positions) == len(set(positions)), "a prompt was trained on twice"
    assert sorted(positions) == list(range(n_prompts)), "a prompt was lost"


def _kill_server(run_dir: Path) -> dict:
    rec = json.loads((run_dir / "servers" / "0.json").read_text())
    os.killpg(int(rec["pid"]), signal.SIGKILL)
    return rec


def _hold_server(run_dir: Path, proc, min_queued: int) -> None:
    """Pause the server's generation and wait until at least ``min_queued`` requests are held by it. The
    run cannot move past the held requests, so a kill after this lands where the test says (inside an
    evaluation, in the middle of the run) however fast the machine is."""
    import httpx

    addr = json.loads((run_dir / "servers" / "0.json").read_text())["address"]

    def held() -> bool:
        # Paused again each time: a weight push of the trainer's own ends with continue_generation.
        assert httpx.post(f"http://{addr}/pause_generation", json={}, timeout=30).status_code == 200
        load = httpx.get(f"http://{addr}/get_load", timeout=30).json()
        return load["paused"] and load["waiting"] + load["running"] >= min_queued

    # Polled often: on a fast machine a step's whole rollout can fit between two slower polls (CI once
    # caught it only at step 9 of 10 with 0.3 s polls and 128-token rollouts).
    _wait_for(held, proc, 300, f"{min_queued} requests held by the paused server", interval=0.05)


def _hold_then_kill(run_dir: Path, proc, min_queued: int) -> dict:
    """:func:`_hold_server`, then SIGKILL the server's process group."""
    _hold_server(run_dir, proc, min_queued)
    return _kill_server(run_dir)
