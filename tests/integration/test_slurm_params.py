"""The plan → sbatch mapping, checked on the sbatch script submitit itself writes (no cluster needed)."""

from __future__ import annotations

import pickle

from areal_cli.config.compose import load_config
from areal_cli.launchers.slurm import SlurmNodeJob, make_executor, slurm_parameters, srun_args_for
from areal_cli.trainer.build import layout_from_plan


def _sbatch(cfg, tmp_path) -> str:
    layout = layout_from_plan(cfg, None)
    ex = make_executor(cfg, layout, str(tmp_path))
    return ex._executor._make_submission_file_text("python -m x", "uid")


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
