"""The run-dir reader (runs/rundir.py) on run dirs written the way launchers and the trainer write them,
and the status writer (job/status.py RunStatusWriter) with its real heartbeat thread."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_cli.job.address_book import publish_server
from areal_cli.job.status import RunStatusWriter, read_status_file
from areal_cli.job.layout import write_json_atomic
from areal_cli.runs import rundir
from areal_cli.trainer.stats import StatsLogger


class _Stats:
    tensorboard = False
    wandb = False


def make_run(root: Path, exp: str, trial: str, *, total: int = 10, warm: int = 0, world: int = 1,
             servers: int = 1, algo: str = "grpo") -> Path:
    d = root / "runs" / exp / trial
    (d / "logs").mkdir(parents=True)
    (d / "config.yaml").write_text(f"experiment_name: {exp}\ntrial_name: {trial}\nalgo:\n  name: {algo}\n"
                                   f"trainer:\n  total_steps: {total}\n  sft_warmup_steps: {warm}\n"
                                   "  eval_every: 5\nlauncher:\n  name: local\n")
    layout = {"servers": [{"index": i, "backend": "hf", "node": 0} for i in range(servers)],
              "trainer": {"dp": world, "tp": 1, "pp": 1, "cp": 1}}
    (d / "launch.json").write_text(json.dumps({"layout": layout, "model_path": "/m"}))
    return d


def log(d: Path, kind: str, step: int, **stats) -> None:
    StatsLogger(str(d), _Stats()).log(kind, step, stats)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_running_needs_a_live_launcher_here_or_a_fresh_heartbeat_elsewhere(tmp_path):
    d = make_run(tmp_path, "e", "t")
    assert rundir.run_state(d)[0] == "starting"  # just launched, no status yet
    assert rundir.run_state(d, now=time.time() + 10 * rundir.STALE_S)[0] == "interrupted"
    here = {"state": "running", "host": socket.gethostname(), "heartbeat": 0.0}
    write_json_atomic(d / "status.json", {**here, "pid": os.getpid()})
    assert rundir.run_state(d) == ("running", f"launcher pid {os.getpid()}")
    write_json_atomic(d / "status.json", {**here, "pid": dead_pid(), "heartbeat": time.time()})
    state, detail = rundir.run_state(d)
    assert state == "interrupted" and "ended without recording" in detail
    now = time.time()
    write_json_atomic(d / "status.json", {"state": "running", "host": "node7", "pid": 1, "heartbeat": now,
                                          "launcher": "slurm"})
    assert rundir.run_state(d, now=now + 1)[0] == "running"
    state, detail = rundir.run_state(d, now=now + rundir.STALE_S + 1)
    assert state == "interrupted" and "node7" in detail
    for written, shown in (("done", "finished"), ("failed", "failed"), ("interrupted", "interrupted")):
        write_json_atomic(d / "status.json", {"state": written})
        assert rundir.run_state(d)[0] == shown


def test_queued_slurm_job_and_a_run_from_before_status_files(tmp_path):
    d = make_run(tmp_path, "e", "q")
    (d / "slurm_job.json").write_text(json.dumps({"job_id": "42"}))
    assert rundir.run_state(d) == ("queued", "slurm job 42 submitted, not started")
    old = make_run(tmp_path, "e", "old")
    log(old, "event", 0, event="start")
    log(old, "event", 10, event="end")
    assert rundir.run_state(old)[0] == "finished"


def test_status_writer_beats_then_records_the_end(tmp_path):
    w = RunStatusWriter(tmp_path, "local", interval_s=0.05, node=0)
    w.start()
    first = read_status_file(tmp_path)
    assert first["state"] == "running" and first["pid"] == os.getpid() and first["launcher"] == "local"
    deadline = time.time() + 30
    while read_status_file(tmp_path).get("heartbeat") == first["heartbeat"] and time.time() < deadline:
        time.sleep(0.02)
    assert read_status_file(tmp_path)["heartbeat"] > first["heartbeat"]
    w.end("failed", "trainer rank 1 failed (exit code 1); everything was stopped. Last log lines:\nTraceback")
    end = read_status_file(tmp_path)
    assert end["state"] == "failed" and end["started"] == first["started"]
    assert end["error"] == "trainer rank 1 failed (exit code 1); everything was stopped. Last log lines:"
    w._thread.join(timeout=30)
    assert not w._thread.is_alive() and read_status_file(tmp_path) == end  # the beat never overwrites an end


def test_phase_step_eta_and_last_eval_from_metrics(tmp_path):
    d = make_run(tmp_path, "e", "t", total=10, warm=4)
    here = {"state": "running", "host": socket.gethostname(), "pid": os.getpid()}
    write_json_atomic(d / "status.json", {**here, "started": time.time() - 60})
    log(d, "event", 0, event="start", resumed_from=0)
    assert rundir.summary(d)["phase"] == "base eval"
    log(d, "eval", 0, **{"eval/pass@1": 0.1, "phase": "base"})
    log(d, "sft", 1, **{"sft/loss": 3.0})
    time.sleep(0.01)
    log(d, "sft", 2, **{"sft/loss": 2.5})
    s = rundir.summary(d)
    assert (s["phase"], s["sft_step"], s["step"], s["sft_loss"]) == ("sft warmup", 2, 0, 2.5)
    assert s["eta_s"] is None and s["phase_eta_s"] is not None and s["phase_eta_s"] > 0
    log(d, "sft", 4, **{"sft/loss": 2.0})
    log(d, "eval", 0, **{"eval/pass@1": 0.3, "phase": "sft"})
    for step in (1, 2, 3):
        time.sleep(0.01)
        log(d, "train", step, **{"reward/mean": step / 4, "perf/samples_per_s": 5.0 + step,
                                 "staleness/mean": 0.5, "staleness/max": 1.0})
    s = rundir.summary(d)
    assert (s["phase"], s["step"], s["total_steps"]) == ("rl", 3, 10)
    assert (s["reward"], s["samples_per_s"]) == (0.75, 8.0)
    assert s["eta_s"] is not None and s["eta_s"] > 0
    assert (s["last_eval"]["accuracy"], s["last_eval"]["phase"]) == (0.3, "sft")
    assert s["first_eval"]["phase"] == "base"
    for step in (4, 5):
        log(d, "train", step, **{"reward/mean": 0.5})
    assert rundir.summary(d)["phase"] == "eval"  # step 5 is an eval_every boundary with no eval record yet
    log(d, "eval", 5, **{"eval/pass@1": 0.5, "phase": "rl"})
    assert rundir.summary(d)["phase"] == "rl"
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 6, "ti')  # a torn last line: the run is writing it
    assert rundir.summary(d)["step"] == 5


def test_resolve_run_by_path_name_experiment_and_latest(tmp_path):
    a1 = make_run(tmp_path, "a", "one")
    a2 = make_run(tmp_path, "a", "two")
    b = make_run(tmp_path, "b", "x")
    for i, d in enumerate((a2, a1, b)):  # activity order: b newest, then a1, then a2
        t = time.time() - 100 + 10 * i
        for name in ("config.yaml", "launch.json"):
            os.utime(d / name, (t, t))
    root = str(tmp_path)
    assert rundir.resolve_run(None, root) == b
    assert rundir.resolve_run("a", root) == a1
    assert rundir.resolve_run("a/two", root) == a2
    assert rundir.resolve_run(str(a2), root) == a2.resolve()
    assert rundir.resolve_run(str(a2.parent), "/nonexistent") == a1.resolve()  # an experiment dir
    assert [p.name for p in rundir.list_runs(root)] == ["x", "one", "two"]
    with pytest.raises(rundir.RunNotFound) as e:
        rundir.resolve_run("a/three", root)
    assert str(e.value).startswith("no run 'a/three'") and "b/x, a/one, a/two" in str(e.value)
    with pytest.raises(rundir.RunNotFound, match="no runs under"):
        rundir.resolve_run(None, str(tmp_path / "empty"))


def test_processes_and_the_error_a_failed_run_shows(tmp_path):
    d = make_run(tmp_path, "e", "t", world=2, servers=2)
    here = {"state": "running", "host": socket.gethostname(), "pid": os.getpid()}
    write_json_atomic(d / "status.json", here)
    publish_server(d, 0, "127.0.0.1:1234", 1, 99, "hf")
    (d / "logs" / "server0.log").write_text("serving\n")
    (d / "logs" / "server1.log").write_text("Traceback (most recent call last):\n  File \"x\", line 1\n"
                                           "torch.OutOfMemoryError: CUDA out of memory. Tried\nmore\n")
    (d / "logs" / "trainer_rank0.log").write_text("step 1\n")
    s = rundir.snapshot(d)
    assert [(p["name"], p["state"], p["address"], p["restarts"]) for p in s["servers"]] == [
        ("server0", "up", "127.0.0.1:1234", 1), ("server1", "starting", None, 0)]
    assert s["servers"][1]["error"] == "torch.OutOfMemoryError: CUDA out of memory. Tried"
    assert [(p["rank"], p["state"]) for p in s["trainer_ranks"]] == [(0, "running"), (1, "starting")]

    (d / "logs" / "trainer_rank1.log").write_text(
        "Traceback (most recent call last):\n  File \"entry.py\"\nareal_cli.errors.DataError: long\n"
        "areal user error: dataset.train_path: no 'question' column — fix: set dataset.prompt_field\n")
    write_json_atomic(d / "status.json", {"state": "failed", "error": "trainer rank 1 (...) failed"})
    s = rundir.snapshot(d)
    assert s["error"] == "dataset.train_path: no 'question' column — fix: set dataset.prompt_field"
    assert [(p["rank"], p["state"]) for p in s["trainer_ranks"]] == [(0, "stopped"), (1, "failed")]
    (d / "node_errors").mkdir()
    write_json_atomic(d / "node_errors" / "1.json", {"node": 1, "type": "LaunchError", "message": "no model"})
    assert rundir.snapshot(d)["error"] == "no model"  # a node's own typed line comes first


def test_log_for_names_the_logs_there_are(tmp_path):
    d = make_run(tmp_path, "e", "t", world=2, servers=1)
    with pytest.raises(rundir.RunNotFound, match="trainer rank 0 has no log .* yet"):
        rundir.log_for(d)
    (d / "logs" / "trainer_rank0.log").write_text("x")
    (d / "logs" / "server0.log").write_text("y")
    assert rundir.log_for(d) == d / "logs" / "trainer_rank0.log"
    assert rundir.log_for(d, server=0) == d / "logs" / "server0.log"
    with pytest.raises(rundir.RunNotFound) as e:
        rundir.log_for(d, rank=1)
    assert str(e.value) == (f"trainer rank 1 has no log in {d / 'logs'} (trainer ranks of e/t: 0, 1) — fix: "
                            "pass --rank 0")
    with pytest.raises(rundir.RunNotFound) as e:
        rundir.log_for(d, server=3)
    assert str(e.value) == "the run has no server 3 (servers of e/t: 0) — fix: pass --server 0"
