"""The smoke override every example runs under in CI: the example's own config (algorithm, workflow,
reward, critic, LoRA, engine) with the tiny model, a tiny dataset of the same shape, a CPU allocation
and a few steps. ``examples/README.md`` prints the same list for users who want to try a recipe on a
laptop before they book GPUs."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def smoke_overrides(fileroot: Path, model_dir: str, *, model: str = "tiny", **extra: object) -> list[str]:
    """``areal train`` overrides that shrink an example to a CPU smoke run (``extra`` wins)."""
    base: dict[str, object] = {
        "model": model, "model.path": model_dir, "cluster": "local_cpu", "allocation_mode": "local_cpu",
        "launcher": "local", "engine.dtype": "float32", "cluster.fileroot": str(fileroot),
        "experiment_name": "smoke", "trial_name": "t0",
        "dataset.train_path": "builtin:arith", "dataset.test_path": "null", "dataset.train_size": 64,
        "dataset.test_size": 4, "dataset.max_prompt_len": 256,
        "trainer.total_steps": 2, "trainer.eval_every": 0, "trainer.save_every": 0,
        "trainer.recover_every": 0, "trainer.total_epochs": "null",
        "algo.batch_size": 2, "rollout.group_size": 2, "rollout.gconfig.max_new_tokens": 8, "rollout.eval_gconfig.max_new_tokens": 8,
        "rollout.max_concurrent_rollouts": 8, "rollout.weight_update_dtype": "float32",
        "stats.live": "false", "stats.wandb": "false",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
