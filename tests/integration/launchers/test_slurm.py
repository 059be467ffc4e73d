"""`areal train launcher=slurm` on a real single-node SLURM brought up by slurm/local-cluster.sh.

Run with: python -m pytest -m slurm tests/integration/launchers/test_slurm.py   (root; installs slurm-wlm if missing)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
# Runs that get cancelled or requeued mid-way: long enough that the signal lands before the last step.
LONG = 40


def _overrides(fileroot: Path, model_dir: str, **extra: object) -> list[str]:
    base = {
        "cluster.fileroot": str(fileroot), "model.path": model_dir, "experiment_name": "slurm",
        "trial_name": "t0", "trainer.total_steps": 6, "trainer.sft_warmup_steps": 0,
        "trainer.recover_every": 2, "trainer.save_every": 2, "trainer.eval_every": 3,
        "algo.batch_size": 2, "rollout.group_size": 2, "rollout.gconfig.max_new_tokens": 6,
        "rollout.max_head_offpolicyness": 1, "rollout.max_concurrent_rollouts": 8,
        "rollout.weight_update": "disk", "dataset.train_size": 200, "dataset.test_size": 8,
        "dataset.max_prompt_len": 256, "stats.live": "false", "launcher": "slurm",
        "launcher.slurm.cpus_per_task": 2, "launcher.slurm.mem_gb": 8, "launcher.slurm.time_min": 20,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _areal(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               AREAL_TEST_MARKER="slurm-env-propagates")
    return subprocess.Popen([sys.executable, "-m", "areal_cli.cli.main", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _records(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _wait_for_recover(proc: subprocess.Popen, run_dir: Path, timeout: float = 400) -> int:
    deadline = time.time() + timeout
    latest = run_dir / "recover" / "latest.json"
    while time.time() < deadline and proc.poll() is None:
        if latest.exists():
            return int(json.loads(latest.read_text())["step"])
        time.sleep(0.5)
    out = proc.stdout.read() if proc.poll() is not None else ""
    pytest.fail(f"no recover state appeared (areal exit {proc.poll()}):\n{out[-3000:]}")


def _job_id(run_dir: Path) -> str:
    return json.loads((run_dir / "slurm_job.json").read_text())["job_id"]


def _gone(job_id: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.5)
    pytest.fail(f"job {job_id} still queued: {out}")


def _starts(run_dir: Path) -> list[int]:
    return [r["resumed_from"] for r in _records(run_dir) if r.get("kind") == "event" and r.get("event") == "start"]


def test_submitit_trivial_job_runs_on_local_cluster(slurm_cluster, tmp_path):
    import submitit

    ex = submitit.AutoExecutor(folder=str(tmp_path / "%j"), cluster="slurm")
    ex.update_parameters(nodes=1, tasks_per_node=1, cpus_per_task=1, mem_gb=1, timeout_min=5)

    def where() -> tuple[str, str]:
        env = submitit.JobEnvironment()
        return env.hostnames[0], os.environ.get("SLURM_JOB_ID", "")

    job = ex.submit(where)
    host, jid = job.result()
    assert jid == str(job.job_id)
    assert host == subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


def test_slurm_train_completes_then_cancel_and_resubmit_resumes(slurm_cluster, tmp_path, tiny_model_dir):
    # 1. A short run to completion: metrics and checkpoints land in the run dir.
    root_a = tmp_path / "a"
    run_a = root_a / "runs" / "slurm" / "t0"
    p = _areal(_overrides(root_a, tiny_model_dir))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    train = [r for r in _records(run_a) if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert (run_a / "checkpoints" / "final" / "config.json").is_file()
    assert json.loads((run_a / "recover" / "latest.json").read_text())["step"] >= 4
    jid = _job_id(run_a)
    log_dir = run_a / "slurm" / jid
    assert log_dir.is_dir() and any(log_dir.glob("*_log.out"))
    assert (run_a / "logs" / "trainer_rank0.log").is_file()
    # The submission environment reached the job (sbatch exports it).
    sh = next(log_dir.glob("*_submission.sh")).read_text()
    assert "#SBATCH --requeue" in sh and "#SBATCH --cpus-per-task=2" in sh and "#SBATCH --mem=8GB" in sh
    # `areal status` / `runs` / `logs` read the finished job from its run dir alone, as for a local run.
    from run_commands import check_finished_run

    check_finished_run(run_a, root_a, total_steps=6, launcher="slurm")
    assert json.loads((run_a / "status.json").read_text())["slurm_job"] == jid

    # 2. scancel mid-run, then resubmit with resume=auto: it continues from the recover step.
    root_b = tmp_path / "b"
    run_b = root_b / "runs" / "slurm" / "t0"
    # 40 steps: on a fast machine 6 steps ran between the first recover state and the scancel taking effect.
    p = _areal(_overrides(root_b, tiny_model_dir, **{"trainer.total_steps": LONG}))
    step = _wait_for_recover(p, run_b)
    job = _job_id(run_b)
    subprocess.run(["scancel", job], check=True)
    out, _ = p.communicate(timeout=180)
    assert p.returncode != 0
    assert f"slurm job {job}" in out
    _gone(job)
    done_before = max(r["step"] for r in _records(run_b) if r.get("kind") == "train")
    assert done_before < LONG
    p = _areal(_overrides(root_b, tiny_model_dir, **{"trainer.total_steps": LONG, "resume": "auto"}))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    assert _job_id(run_b) != job
    starts = _starts(run_b)
    assert starts[0] == 0 and starts[-1] >= step >= 2, starts
    steps_after = [r["step"] for r in _records(run_b) if r.get("kind") == "train"]
    assert steps_after[-1] == LONG


def test_requeue_resumes_from_recover_checkpoint(slurm_cluster, tmp_path, tiny_model_dir):
    """``scontrol requeue`` (what preemption does): the same job restarts with resume=auto."""
    root = tmp_path / "rq"
    run = root / "runs" / "slurm" / "t0"
    p = _areal(_overrides(root, tiny_model_dir, **{"trainer.total_steps": LONG}))
    step = _wait_for_recover(p, run)
    job = _job_id(run)
    subprocess.run(["scontrol", "requeue", job], check=True)
    out, _ = p.communicate(timeout=700)
    assert p.returncode == 0, out[-4000:]
    assert _job_id(run) == job  # same job id: requeued, not resubmitted
    starts = _starts(run)
    assert len(starts) >= 2 and starts[0] == 0 and starts[-1] >= step, starts
    cfg_text = (run / "config.yaml").read_text()
    assert "resume: auto" in cfg_text
    assert [r["step"] for r in _records(run) if r.get("kind") == "train"][-1] == LONG


def test_storage_probe_runs_through_srun(slurm_cluster, tmp_path):
    from areal_cli.storage import run_storage_check

    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    rep = run_storage_check([str(tmp_path / "shared")], 1, use_srun=True,
                            srun_args=["--time", "5", "--mem", "256M", "--cpus-per-task", "1"],
                            throughput_bytes=1024 * 1024, timeout_s=10)
    vis = [r for r in rep.results if r.check == "cross-node visibility"]
    assert vis and vis[0].status == "pass", rep.summary()
    assert {r.node for r in rep.results if r.check == "writable"} == {host}  # SLURMD_NODENAME
