"""`areal runs`, `areal status`, `areal logs` against real local runs under one fileroot: a finished one, one
watched while it runs (`areal export` and `areal eval` on its newest recover state too) and then stopped with Ctrl-C, and one whose trainer dies of a typed user error."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
from run_commands import areal, check_finished_run, cli_env, runs_json, status_json
from train_runs import _env, _overrides, _records, _start, _wait_for

pytestmark = [pytest.mark.runs, pytest.mark.timeout(600)]

SHORT = {"trainer.total_steps": 2, "trainer.eval_every": 1, "trainer.recover_every": 0,
         "trainer.save_every": 0}


@pytest.fixture(scope="module")
def fileroot(tmp_path_factory):
    return tmp_path_factory.mktemp("runcmds")


@pytest.fixture(scope="module")
def finished_run(fileroot, tiny_model_dir):
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train",
                          *_overrides(fileroot, tiny_model_dir, trial_name="done", **SHORT)],
                         capture_output=True, text=True, env=_env(), timeout=400, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return fileroot / "runs" / "itest" / "done"


def test_finished_run(finished_run, fileroot):
    s = check_finished_run(finished_run, fileroot, total_steps=2, launcher="local")
    st = json.loads((finished_run / "status.json").read_text())
    assert st["state"] == "done" and st["launcher"] == "local" and st["ended"] >= st["started"]
    assert s["started"] == st["started"]


# Far more steps than the checks below take on a loaded machine: at 400 the run once finished (at load 10) before
# the test's Ctrl-C reached it.
LIVE_STEPS = 100_000


def test_running_run_then_ctrl_c(finished_run, fileroot, tiny_model_dir):
    run_dir = fileroot / "runs" / "itest" / "live"
    proc = _start(_overrides(fileroot, tiny_model_dir, trial_name="live", **{"trainer.total_steps": LIVE_STEPS,
                                                                                "trainer.eval_every": 0,
                                                                                "trainer.recover_every": 2}))
    follower = None
    try:
        _wait_for(lambda: sum(r["kind"] == "train" for r in _records(run_dir)) >= 2, proc, 300, "two steps")
        s = status_json("--fileroot", str(fileroot))  # no RUN: the most recently active run is this one
        assert (s["run"], s["state"], s["phase"], s["total_steps"]) == ("itest/live", "running", "rl", LIVE_STEPS), s
        assert f"pid {proc.pid}" in s["state_detail"]
        assert s["step"] >= 2 and s["eta_s"] is not None and s["eta_s"] > 0
        assert s["samples_per_s"] > 0 and s["error"] is None
        assert [(p["name"], p["state"]) for p in s["servers"]] == [("server0", "up")]
        published = json.loads((run_dir / "servers" / "0.json").read_text())
        assert s["servers"][0]["address"] == published["address"]
        assert [(p["rank"], p["state"]) for p in s["trainer_ranks"]] == [(0, "running")]
        rows = runs_json(fileroot)
        assert rows["itest/live"]["state"] == "running" and rows["itest/done"]["state"] == "finished"
        assert next(iter(rows)) == "itest/live"
        text = areal("status", "itest/live", "--fileroot", str(fileroot))
        assert text.returncode == 0 and "running" in text.stdout and f"/{LIVE_STEPS}" in text.stdout, text.stdout
        log = areal("logs", "itest", "--fileroot", str(fileroot))  # EXPERIMENT: its latest trial, this one
        assert log.returncode == 0 and "trainer rank 0/1 pid" in log.stdout, log.stdout[-2000:]

        # eval and export take a running run's newest complete checkpoint (HF export or recover state; a
        # half-written recover state is .partial)
        _wait_for(lambda: any(p.is_dir() and not p.name.endswith(".partial")
                              for p in (run_dir / "recover").glob("step_*")), proc, 300, "a recover state")
        out_dir = fileroot / "live_export"
        ex = areal("export", "itest/live", "--fileroot", str(fileroot), "--to", str(out_dir), "--json")
        assert ex.returncode == 0, ex.stderr
        source = json.loads(ex.stdout)["source"]
        assert source.startswith(str(run_dir)) and "/step_" in source and (out_dir / "config.json").is_file()
        assert any(out_dir.glob("*.safetensors"))
        ev = areal("eval", "itest/live", "--fileroot", str(fileroot), "dataset.test_size=8",
                   "eval_gconfig.max_new_tokens=4", "--json", timeout=300)
        assert ev.returncode == 0, ev.stderr[-3000:]
        got = json.loads(ev.stdout)
        assert got["run_dir"] == str(run_dir) and got["kind"] in ("hf", "recover") and got["n"] == 8, got
        assert 0.0 <= got["accuracy"] <= 1.0, got

        # -f follows the server's log while the run lives, and ends by itself once the run has stopped.
        follower = subprocess.Popen([sys.executable, "-m", "areal_cli.cli.main", "logs", str(run_dir),
                                     "--server", "0", "-f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=cli_env())
        first = follower.stdout.readline()
        assert first and follower.poll() is None, follower.stderr.read() if follower.poll() else ""
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-3000:]
        rest, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
        log_text = (run_dir / "logs" / "server0.log").read_text()
        assert log_text.endswith(first + rest)  # it printed the whole log, up to what the server wrote last
    finally:
        for p in (proc, follower):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()

    s = status_json(str(run_dir))
    assert (s["state"], s["phase"], s["eta_s"]) == ("interrupted", "rl", None), s
    assert [p["state"] for p in s["servers"]] == ["stopped"] and s["error"] is None
    assert [p["state"] for p in s["trainer_ranks"]] == ["stopped"]
    assert runs_json(fileroot)["itest/live"]["state"] == "interrupted"


PLUGIN = textwrap.dedent('''
    """Dies in the trainer ranks alone, the way a dataset mistake found while reading the data does."""
    import os
    import sys

    if os.environ.get("RANK") is not None and sys.argv[0].endswith(os.path.join("trainer", "entry.py")):
        from areal_cli.errors import DataError

        raise DataError("dataset.train_path: rows 9-16 have no 'question' column — fix: set "
                        "dataset.prompt_field to a column every row has")
''')


def test_failed_run_shows_the_typed_error(fileroot, tiny_model_dir, tmp_path):
    (tmp_path / "dies_in_trainer.py").write_text(PLUGIN)
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", "plugins=[dies_in_trainer]",
                          *_overrides(fileroot, tiny_model_dir, trial_name="bad", **SHORT)],
                         capture_output=True, text=True, env=env, timeout=400, check=False)
    assert res.returncode == 1, (res.stdout + res.stderr)[-3000:]
    run_dir = fileroot / "runs" / "itest" / "bad"
    s = status_json(str(run_dir))
    line = ("dataset.train_path: rows 9-16 have no 'question' column — fix: set dataset.prompt_field to a "
            "column every row has")
    assert (s["state"], s["error"]) == ("failed", line), s
    assert [(p["rank"], p["state"], p["error"]) for p in s["trainer_ranks"]] == [(0, "failed", line)]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    text = areal("status", str(run_dir))
    assert text.returncode == 0 and line in text.stdout, text.stdout
    assert runs_json(fileroot)["itest/bad"]["state"] == "failed"


def test_unknown_run_and_conflicting_flags_are_one_line(fileroot):
    p = areal("status", "nosuch/run", "--fileroot", str(fileroot))
    assert p.returncode == 1 and p.stderr.startswith("error: no run 'nosuch/run'") and "— fix:" in p.stderr
    assert len(p.stderr.splitlines()) == 1
    p = areal("logs", "--rank", "0", "--server", "0", "--fileroot", str(fileroot))
    assert p.returncode == 2
    assert p.stderr == "error: --rank and --server name different logs — fix: pass one of them\n"
