"""`areal sweep` for real: four short `areal train` trials of the built-in task, killed midway and resumed.

Checks the must-shows of the sweep issue: the table, results.csv and the plot are produced; a resumed
sweep reruns only unfinished trials; invalid trials are reported, not crashed on.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

SHORT = [
    "trainer.total_steps=1", "trainer.sft_warmup_steps=0", "trainer.recover_every=0", "trainer.eval_every=0",
    "algo.batch_size=2", "rollout.group_size=2", "rollout.gconfig.max_new_tokens=4",
    "rollout.max_head_offpolicyness=0", "dataset.train_size=50", "dataset.test_size=4",
    "dataset.max_prompt_len=256", "rollout.weight_update=disk",
]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}


def _sweep(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "areal_cli.cli.main", "sweep", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True, **kw)


def _manifest(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "manifest.json").read_text())


@pytest.mark.e2e  # kills and resumes real runs: CI's e2e phase
def test_sweep_runs_kills_and_resumes(tmp_path, tiny_model_dir):
    sweep_dir = tmp_path / "sw"
    fixed = [f"cluster.fileroot={tmp_path}", f"model.path={tiny_model_dir}", *SHORT]
    proc = _sweep(*fixed, "algo.optim.lr=1e-3,3e-3", "seed=1,2", "--sweep-dir", str(sweep_dir),
                  "--max-parallel", "1")
    # Kill the whole sweep (and its running trial) once the first trial has finished.
    deadline = time.time() + 400
    while time.time() < deadline:
        if (sweep_dir / "manifest.json").is_file():
            states = [t["status"] for t in _manifest(sweep_dir)["trials"]]
            if states.count("done") >= 1 and "running" in states:
                break
        if proc.poll() is not None:
            pytest.fail("sweep ended before it could be killed:\n" + proc.stdout.read()[-3000:])
        time.sleep(0.5)
    else:
        pytest.fail("first trial never finished")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # The running trial (its own session, out of reach of the group kill) must not outlive the sweep:
    # the resumed sweep below reruns it in the same run dir.
    import psutil

    def trial_procs():
        return [p for p in psutil.process_iter(["cmdline"])
                if "train" in (p.info["cmdline"] or []) and f"cluster.fileroot={tmp_path}" in (p.info["cmdline"] or [])]

    deadline = time.time() + 90
    while trial_procs() and time.time() < deadline:
        time.sleep(0.5)
    assert not trial_procs(), "the killed sweep's running trial is still alive"
    killed = _manifest(sweep_dir)
    for t in killed["trials"]:
        if t["status"] == "running":  # stopped by the parent-death signal, not run on to the end
            status = Path(t["run_dir"], "status.json")  # absent when it died before launching anything
            state = json.loads(status.read_text())["state"] if status.is_file() else None
            assert state != "done", f"trial {t['id']} outlived the sweep and ran to the end"
    done_first = {t["id"]: t for t in killed["trials"] if t["status"] == "done"}
    assert 1 <= len(done_first) < 4

    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "sweep", "--resume", str(sweep_dir),
                          "--max-parallel", "1"], capture_output=True, text=True, env=_env(), timeout=800)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    final = _manifest(sweep_dir)
    assert [t["status"] for t in final["trials"]] == ["done"] * 4
    for t in final["trials"]:
        if t["id"] in done_first:
            assert t["attempts"] == 1, "a finished trial was rerun"
            assert t["metrics"] == done_first[t["id"]]["metrics"]
        assert Path(t["run_dir"], "metrics.jsonl").is_file()
        assert 0.0 <= t["metrics"]["accuracy_after"] <= 1.0
    # Distinct trials wrote distinct run dirs.
    assert len({t["run_dir"] for t in final["trials"]}) == 4

    rows = list(csv.DictReader(open(sweep_dir / "results.csv")))
    assert len(rows) == 4 and {r["algo.optim.lr"] for r in rows} == {"0.001", "0.003"}
    assert {r["seed"] for r in rows} == {"1", "2"}
    png = sweep_dir / "sweep.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best" in res.stdout and "accuracy_after" in res.stdout


def test_invalid_trials_are_reported_not_crashed(tmp_path):
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "sweep", "--dry-run",
                          f"cluster.fileroot={tmp_path}", "allocation_mode=hf:d1+fsdp:d1,hf:d1+fsdp:d4",
                          "algo.optim.lr=1e-3,2e-3", "--sweep-dir", str(tmp_path / "sw")],
                         capture_output=True, text=True, env={**_env(), "COLUMNS": "200"}, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert "4 trial(s), 2 invalid" in res.stdout
    assert "needs 5 devices but the cluster has 2" in res.stdout
    assert not (tmp_path / "sw" / "manifest.json").exists(), "a dry run must not write a manifest"

    strict = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "sweep", "--strict",
                             f"cluster.fileroot={tmp_path}", "allocation_mode=hf:d1+fsdp:d1,hf:d1+fsdp:d4",
                             "--sweep-dir", str(tmp_path / "sw2")],
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert strict.returncode == 2, strict.stdout + strict.stderr
    assert "Traceback" not in strict.stdout + strict.stderr
    assert "--strict" in strict.stderr and "invalid" in strict.stderr


def test_nothing_to_sweep_is_a_usage_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "sweep", f"cluster.fileroot={tmp_path}",
                          "algo.optim.lr=1e-3"], capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 2 and "nothing to sweep" in res.stderr


@pytest.mark.slow
def test_interval_sweep_runs_an_optuna_search(tmp_path, tiny_model_dir):
    sweep_dir = tmp_path / "sw"
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "sweep", f"cluster.fileroot={tmp_path}",
                          f"model.path={tiny_model_dir}", *SHORT, "algo.optim.lr=tag(log,interval(1e-4,1e-2))",
                          "--n-trials", "2", "--max-parallel", "1", "--sweep-dir", str(sweep_dir)],
                         capture_output=True, text=True, env=_env(), timeout=800)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    m = _manifest(sweep_dir)
    assert m["search"] and [t["status"] for t in m["trials"]] == ["done", "done"]
    lrs = [float(t["overrides"][0].split("=", 1)[1]) for t in m["trials"]]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and lrs[0] != lrs[1]  # sampled by optuna, inside the interval
