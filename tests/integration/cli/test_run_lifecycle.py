"""Living with real `areal train` runs that name themselves: unique default names, a trainer's error as one
line, Ctrl-C's resume command, and what a resume says, refuses and accepts.

One experiment (``life``) under one fileroot, its runs in order (module fixtures, each run once):

1. a JSONL whose prompts are all empty: a typed error raised inside trainer rank 0;
2. a run interrupted with SIGINT once its first recover state exists;
3. ``resume=auto algo.batch_size=4`` with no name: refused (the latest run's batch shape), nothing launched;
4. the resume command Ctrl-C printed, with ``trainer.total_steps`` raised (a harmless change);
5. ``resume=force algo.batch_size=4`` with no name: proceeds on the latest run;
6. ``resume=force`` with a plugin that crashes every trainer rank with a RuntimeError
   (tests/support/crash_plugin.py): the untyped error's line, then the command that resumes.

None of the runs names a trial: 1 and 2 are two run dirs, 3-6 find the latest of them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_runs import _env, _overrides, _records

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXPERIMENT = "life"
NAME = re.compile(r"^\d{8}-\d{6}(-\d+)?$")
SUPPORT = str(Path(__file__).resolve().parents[2] / "support")


def _base(root: Path, model_dir: str, **extra) -> list[str]:
    over = _overrides(root, model_dir, experiment_name=EXPERIMENT, **{
        "trainer.total_steps": 8, "trainer.recover_every": 2, "trainer.save_every": 0, "trainer.eval_every": 0,
        "dataset.test_size": 4, **extra})
    return [o for o in over if not o.startswith("trial_name=")]


def _env_with_support() -> dict[str, str]:
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([SUPPORT, env.get("PYTHONPATH", "")])
    return env


def _train(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], capture_output=True,
                          text=True, env=_env_with_support(), timeout=timeout)


def _runs(root: Path) -> list[Path]:
    return sorted((root / "runs" / EXPERIMENT).iterdir())


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("life")


@pytest.fixture(scope="module")
def typed(root, tiny_model_dir) -> subprocess.CompletedProcess:
    data = root / "empty_prompts.jsonl"
    data.write_text("".join(json.dumps({"question": "", "answer": f"#### {i}"}) + "\n" for i in range(20)))
    return _train(_base(root, tiny_model_dir, **{"dataset.train_path": str(data), "dataset.test_fraction": 0.2}))


@pytest.fixture(scope="module")
def interrupted(root, tiny_model_dir, typed) -> dict:
    before = set(_runs(root))
    proc = subprocess.Popen([sys.executable, "-m", "areal_cli.cli.main", "train", *_base(root, tiny_model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env_with_support(),
                            start_new_session=True)
    deadline = time.time() + 300
    run_dir = None
    while time.time() < deadline and proc.poll() is None:
        new = set(_runs(root)) - before
        run_dir = next(iter(new), None)
        if run_dir is not None and (run_dir / "recover" / "latest.json").exists():
            break
        time.sleep(0.2)
    assert proc.poll() is None and run_dir is not None, f"ended early:\n{proc.communicate()[0][-3000:]}"
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does to the foreground `areal train`
    out, _ = proc.communicate(timeout=120)
    recovered = json.loads((run_dir / "recover" / "latest.json").read_text())["step"]
    return {"rc": proc.returncode, "out": out, "run_dir": run_dir, "step": recovered}


@pytest.fixture(scope="module")
def refused(root, tiny_model_dir, interrupted) -> dict:
    run_dir = interrupted["run_dir"]

    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}

    before, runs = files(), _runs(root)
    res = _train([*_base(root, tiny_model_dir), "resume=auto", "algo.batch_size=4"])
    return {"res": res, "files": (before, files()), "runs": (runs, _runs(root))}


@pytest.fixture(scope="module")
def resumed(interrupted, refused) -> dict:
    line = next(ln for ln in interrupted["out"].splitlines() if "to resume from step" in ln)
    argv = shlex.split(line.split(": ", 1)[1])
    assert argv[:2] == ["areal", "train"], argv
    res = _train([*argv[2:], "trainer.total_steps=10"])
    return {"res": res, "argv": argv, "records": _records(interrupted["run_dir"])}


@pytest.fixture(scope="module")
def forced(root, tiny_model_dir, resumed) -> subprocess.CompletedProcess:
    return _train([*_base(root, tiny_model_dir), "trainer.total_steps=10", "resume=force", "algo.batch_size=4"])


@pytest.fixture(scope="module")
def crashed(root, tiny_model_dir, forced) -> subprocess.CompletedProcess:
    return _train([*_base(root, tiny_model_dir), "trainer.total_steps=10", "resume=force", "plugins=[crash_plugin]"])


def test_a_typed_error_in_a_trainer_rank_is_its_own_line_with_the_log_path(typed):
    res = typed
    assert res.returncode == 1, res.stderr[-3000:]
    errors = _error_lines(res.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: dataset.train_path: no usable rows in "), res.stderr
    i = res.stderr.splitlines().index(errors[0])
    where = res.stderr.splitlines()[i + 1]
    assert re.fullmatch(r"  raised in trainer rank 0; log \S+/logs/trainer_rank0\.log; everything was stopped", where)
    assert "Traceback" not in res.stderr + res.stdout


def test_an_untyped_crash_gives_the_exception_line_the_rank_the_log_and_the_resume_command(crashed, interrupted):
    from crash_plugin import CRASH_MESSAGE

    res, run_dir = crashed, interrupted["run_dir"]
    assert res.returncode == 1, res.stderr[-3000:]
    assert _error_lines(res.stderr) == [f"error: trainer rank 0 failed: RuntimeError: {CRASH_MESSAGE}"], res.stderr
    lines = res.stderr.splitlines()
    i = lines.index(_error_lines(res.stderr)[0])
    assert lines[i + 1] == f"  exit code 1; log {run_dir / 'logs' / 'trainer_rank0.log'}; everything was stopped"
    step = json.loads((run_dir / "recover" / "latest.json").read_text())["step"]
    assert lines[i + 2].startswith(f"  to resume from step {step}: areal train ")
    argv = shlex.split(lines[i + 2].split(": ", 1)[1])
    assert argv[-3:] == ["plugins=[crash_plugin]", f"trial_name={run_dir.name}", "resume=auto"], argv
    log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert "Traceback (most recent call last)" in log  # it is in the log, not on the console
    assert "Traceback" not in res.stderr + res.stdout


def test_runs_without_a_name_get_their_own_timestamped_dirs(root, typed, interrupted):
    names = [p.name for p in _runs(root)]
    assert len(names) == 2 and all(NAME.match(n) for n in names), names
    assert names[1] == interrupted["run_dir"].name
    assert f"runs/{EXPERIMENT}/{names[0]};" in typed.stderr  # the failed run printed the dir it made
    status = json.loads((root / "runs" / EXPERIMENT / names[0] / "status.json").read_text())
    assert status["state"] == "failed" and "no usable rows" in status["error"]


def test_ctrl_c_prints_the_command_that_resumes(interrupted):
    assert interrupted["rc"] == 130, interrupted["out"][-3000:]
    lines = interrupted["out"].splitlines()
    stop = lines.index("[areal] interrupted: stopping trainer and servers")
    name = interrupted["run_dir"].name
    assert lines[stop + 1].startswith(f"[areal] to resume from step {interrupted['step']}: areal train ")
    assert lines[stop + 1].endswith(f" trial_name={name} resume=auto")


def test_a_resume_that_changes_the_batch_shape_is_refused_before_anything_starts(refused, interrupted):
    res, run_dir = refused["res"], interrupted["run_dir"]
    assert res.returncode == 1, res.stderr[-3000:]
    assert _error_lines(res.stderr) == [
        f"error: resume: {EXPERIMENT}/{run_dir.name}'s checkpoint (step {interrupted['step']}) depends on settings "
        "that changed since the checkpoint: algo.batch_size 2 → 4 — fix: resume with the old values, start a new "
        f"run (trial_name={_new_name(res.stderr)}), or resume=force"]
    assert "[areal]" not in res.stderr  # no run dir line: nothing was prepared or launched
    before, after = refused["files"]
    assert after == before and "config.yaml" in before  # the run dir is untouched
    assert refused["runs"][1] == refused["runs"][0]  # and no new run dir was made


def _new_name(text: str) -> str:
    m = re.search(r"trial_name=(\d{8}-\d{6}(?:-\d+)?)\)", text)
    assert m and NAME.match(m.group(1)), text
    return m.group(1)


def test_the_printed_command_resumes_says_so_and_replays_nothing(resumed, interrupted):
    res, step, run_dir = resumed["res"], interrupted["step"], interrupted["run_dir"]
    assert res.returncode == 0, res.stderr[-4000:]
    lines = res.stderr.splitlines()
    assert f"[areal] resuming {EXPERIMENT}/{run_dir.name} from step {step} (checkpoint " \
           f"{run_dir / 'recover' / f'step_{step:06d}'})" in lines
    assert "[areal] resume: changed: trainer.total_steps 8 → 10" in lines  # harmless: listed and accepted
    shown = [int(m.group(1)) for m in re.finditer(r"^\[areal\] step (\d+)/10 ", res.stderr, re.M)]
    assert shown == list(range(step + 1, 11)), res.stderr  # the earlier launch's steps are not shown again
    assert "eval @ step 0" not in res.stderr
    steps = [r["step"] for r in resumed["records"] if r["kind"] == "train"]
    assert steps == list(range(1, 11))
    starts = [r for r in resumed["records"] if r.get("event") == "start"]
    assert starts[-1]["resumed_from"] == step


def test_resume_force_proceeds_on_the_latest_run(forced, interrupted):
    run_dir = interrupted["run_dir"]
    assert forced.returncode == 0, forced.stderr[-4000:]
    latest = json.loads((run_dir / "recover" / "latest.json").read_text())["step"]
    assert f"[areal] resuming {EXPERIMENT}/{run_dir.name} (the latest run of {EXPERIMENT}) from step " in forced.stderr
    assert "[areal] resume: changed: algo.batch_size 2 → 4" in forced.stderr.splitlines()
    recs = _records(run_dir)
    after = [r for r in recs if r["kind"] == "train" and r["step"] > latest]
    assert after and all(len(r["data/positions"]) == 4 for r in after)  # the new batch shape trained
