"""The plan → sbatch mapping, checked on the sbatch script submitit itself writes.

These run with no SLURM on the machine: PATH is cut down to the venv's bin and a folder of stand-ins
for the basic tools, so ``srun``, ``sbatch`` and ``squeue`` are missing even where SLURM is installed.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.launchers.slurm import SlurmNodeJob, render_sbatch, slurm_parameters, srun_args_for
from areal_cli.trainer.build import layout_from_plan


@pytest.fixture(autouse=True)
def no_slurm_on_path(monkeypatch, tmp_path_factory):
    """PATH without any SLURM tool (the venv's bin first, so `areal` and `python` still resolve)."""
    import shutil
    import sys

    bare = tmp_path_factory.mktemp("bare_bin")
    for tool in ("bash", "sh", "env", "hostname", "uname", "cat", "ls"):
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}:{bare}")
    assert shutil.which("srun") is None and shutil.which("sbatch") is None


def _sbatch(cfg, tmp_path) -> str:
    return render_sbatch(cfg, layout_from_plan(cfg, None), str(tmp_path))


def test_gpu_plan_maps_to_sbatch(tmp_path):
    cfg = load_config(["cluster=gpu_2x8", "allocation_mode=sglang:d8+fsdp:d8", "model=qwen2_5_1_5b",
                       "launcher=slurm", "launcher.slurm.partition=gpu", "launcher.slurm.account=rl",
                       "launcher.slurm.qos=high", "launcher.slurm.time_min=90", "launcher.slurm.mem_gb=200",
                       "launcher.slurm.cpus_per_task=32", "+launcher.slurm.extra_sbatch={exclusive: true}",
                       "launcher.slurm.setup=[module load cuda]", "experiment_name=e", "trial_name=t"])
    layout = layout_from_plan(cfg, None)
    p = slurm_parameters(cfg, layout)
    assert p["nodes"] == 2 and p["tasks_per_node"] == 1 and p["gpus_per_node"] == 8
    text = _sbatch(cfg, tmp_path)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=32", "#SBATCH --mem=200GB", "#SBATCH --time=90",
                 "#SBATCH --partition=gpu", "#SBATCH --account=rl", "#SBATCH --qos=high",
                 "#SBATCH --requeue", "#SBATCH --exclusive", "#SBATCH --job-name=areal-e-t",
                 "#SBATCH --signal=USR2@90", "module load cuda"):
        assert line in text, (line, text)
    assert f"--output={tmp_path}/slurm/%j/%j_0_log.out" in text  # logs live in the run dir
    assert "-m submitit.core._submit" in text and f"{tmp_path}/slurm/%j" in text  # the command it runs
    assert srun_args_for(cfg)[:6] == ["--partition", "gpu", "--account", "rl", "--qos", "high"]


def test_cpu_plan_has_no_gpus_and_requeue_can_be_disabled(tmp_path):
    cfg = load_config(["launcher=slurm", "launcher.slurm.requeue=false", "launcher.slurm.cpus_per_task=2",
                       "launcher.slurm.mem_gb=8"])
    text = _sbatch(cfg, tmp_path)
    flags = [ln.split("=")[0] for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert not any("gpus" in f or "--requeue" in f or "partition" in f or "account" in f for f in flags), flags
    assert "#SBATCH --nodes=1" in text


def test_checkpoint_requeues_with_resume_auto():
    job = SlurmNodeJob("/r", "/r/config.yaml", "/m", {"n_nodes": 1}, resume="none")
    delayed = job.checkpoint()
    again = pickle.loads(pickle.dumps(delayed.function))
    assert isinstance(again, SlurmNodeJob) and again.resume == "auto" and again.run_dir == "/r"


GPU_PLAN = ["launcher=slurm", "cluster=gpu_2x8", "allocation_mode=sglang:d8+fsdp:d8", "model=qwen2_5_1_5b",
            "experiment_name=e", "trial_name=t"]


def _areal(*args: str, fileroot) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", "HF_HUB_OFFLINE": "1"}
    env.pop("AREAL_DEBUG", None)
    return subprocess.run(["areal", "train", *args, f"cluster.fileroot={fileroot}"], capture_output=True,
                          text=True, env=env, timeout=300)


def test_dry_run_prints_the_sbatch_script_without_slurm(tmp_path):
    p = _areal("--dry-run", *GPU_PLAN, fileroot=tmp_path)
    assert p.returncode == 0, p.stderr
    script = p.stdout
    assert script.startswith("#!/bin/bash"), script[:200]
    run_dir = f"{tmp_path}/runs/e/t"
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={run_dir}/slurm/%j/%j_0_log.out"):
        assert line in script, (line, script)
    assert "srun" in script and f"-m submitit.core._submit {run_dir}/slurm/%j" in script
    assert "submitit parameters: name='areal-e-t', nodes=2, tasks_per_node=1" in p.stderr
    assert "not on PATH: this machine can render the job but not submit it" in p.stderr
    assert not os.path.exists(run_dir), "a dry run creates nothing"
    p = _areal("--dry-run", "--json", *GPU_PLAN, "launcher.slurm.requeue=false", fileroot=tmp_path)
    out = json.loads(p.stdout)
    assert out["launcher"]["parameters"]["gpus_per_node"] == 8
    assert "#SBATCH --nodes=2" in out["launcher"]["sbatch"] and "--requeue" not in out["launcher"]["sbatch"]


def test_real_submission_without_slurm_is_one_line(tmp_path):
    p = _areal("launcher=slurm", "trainer.total_steps=1", fileroot=tmp_path)
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "sbatch, srun, squeue, scancel are not on PATH" in lines[0] and "--dry-run" in lines[0]
    assert not os.path.exists(f"{tmp_path}/runs"), "nothing was prepared before the refusal"
