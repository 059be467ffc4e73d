"""Run sweep trials: in parallel local subprocesses under a CPU budget, or as a SLURM job array.

Every trial is one ordinary ``areal train`` with the sweep's fixed overrides, the trial's own
overrides, and ``experiment_name``/``trial_name`` set so that each writes its own run dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli.sweep.manifest import Manifest, Trial
from areal_cli.utils.procs import die_with_parent


def trial_command(manifest: Manifest, trial: Trial) -> list[str]:
    return [sys.executable, "-m", "areal_cli.cli.main", "train", *manifest.fixed, *trial.overrides,
            f"experiment_name={manifest.name}", f"trial_name={trial.id}", "stats.live=false"]


def read_metrics(run_dir: str) -> dict:
    """Final metrics of a run: ``summary.json`` if the trainer wrote one, else the last value of every
    numeric key in ``metrics.jsonl``."""
    summary = Path(run_dir) / "summary.json"
    if summary.is_file():
        try:
            return {k: v for k, v in json.loads(summary.read_text()).items() if isinstance(v, (int, float))}
        except json.JSONDecodeError:
            pass
    out: dict = {}
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a run killed mid-write leaves a torn last line
            out.update({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    return out


def run_trial_process(cmd: list[str], log_path: str, env: dict | None = None) -> int:
    """Run one trial to completion; its own process group so a killed sweep leaves no orphans."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})}, preexec_fn=die_with_parent())
        try:
            return proc.wait()
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_local(manifest: Manifest, trials: list[Trial], max_parallel: int,
              on_update: Callable[[Trial], None] = lambda t: None) -> None:
    """Run ``trials`` with at most ``max_parallel`` at once, updating the manifest as each ends."""
    pending = list(trials)
    running: dict[str, tuple[subprocess.Popen, Trial, float, object]] = {}
    try:
        while pending or running:
            while pending and len(running) < max_parallel:
                t = pending.pop(0)
                log_path = Path(manifest.sweep_dir) / "trials" / t.id / "train.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(log_path, "ab")
                # A sweep killed outright must not leave its trial running: a resumed sweep would
                # start that trial again in the same run dir alongside it.
                proc = subprocess.Popen(trial_command(manifest, t), stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=die_with_parent())
                t.status, t.attempts = "running", t.attempts + 1
                running[t.id] = (proc, t, time.time(), log)
                manifest.save()
                on_update(t)
            for tid, (proc, t, start, log) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                log.close()
                del running[tid]
                _finish(t, rc, time.time() - start)
                manifest.save()
                on_update(t)
            time.sleep(0.5)
    except BaseException:
        for proc, t, _, log in running.values():
            _kill_group(proc)
            log.close()
        manifest.save()
        raise


def _finish(t: Trial, rc: int, wall: float) -> None:
    t.returncode, t.wall_time_s = rc, round(wall, 2)
    t.metrics = read_metrics(t.run_dir)
    t.status = "done" if rc == 0 else "failed"
    if rc != 0:
        t.reason = f"areal train exited {rc}; see trials/{t.id}/train.log"


def slurm_trial(cmd: list[str], log_path: str, run_dir: str) -> dict:
    """Body of one SLURM array task (pickled by submitit and run on the allocated node)."""
    start = time.time()
    rc = run_trial_process(cmd, log_path)
    return {"returncode": rc, "wall_time_s": time.time() - start, "metrics": read_metrics(run_dir)}


def run_slurm(manifest: Manifest, trials: list[Trial], max_parallel: int, slurm_params: dict,
              on_update: Callable[[Trial], None] = lambda t: None) -> None:
    """Submit ``trials`` as one job array with a concurrency limit and wait for all of them."""
    import submitit

    folder = Path(manifest.sweep_dir) / "slurm" / "%j"  # array tasks: %j is "<array id>_<index>"
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    executor.update_parameters(slurm_array_parallelism=max_parallel, name=f"areal-sweep-{manifest.name}",
                               **slurm_params)
    cmds = [trial_command(manifest, t) for t in trials]
    logs = [str(Path(manifest.sweep_dir) / "trials" / t.id / "train.log") for t in trials]
    jobs = executor.map_array(slurm_trial, cmds, logs, [t.run_dir for t in trials])
    for t, job in zip(trials, jobs):
        t.status, t.attempts = "running", t.attempts + 1
        t.reason = f"slurm job {job.job_id}"
    manifest.save()
    for t, job in zip(trials, jobs):
        try:
            res = job.result()
            t.returncode, t.wall_time_s, t.metrics = res["returncode"], round(res["wall_time_s"], 2), res["metrics"]
            t.status = "done" if res["returncode"] == 0 else "failed"
            t.reason = "" if t.status == "done" else f"exit {res['returncode']} (slurm job {job.job_id})"
        except Exception as e:  # submitit raises on a failed/cancelled task; the trial is retried on resume
            t.status, t.reason = "failed", f"slurm job {job.job_id}: {str(e).splitlines()[0][:200]}"
        manifest.save()
        on_update(t)
