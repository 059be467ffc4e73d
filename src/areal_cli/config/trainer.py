"""``trainer`` and ``stats`` sections: loop length, evaluation, checkpoints, logging."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.ranges import ranged


@dataclass
class TrainerConfig:
    total_steps: int = ranged(40, ge=0)
    total_epochs: int | None = ranged(None, ge=1, why="null lets total_steps decide")
    # >0: run SFT for this many steps before RL, in the same command
    sft_warmup_steps: int = ranged(0, ge=0)
    sft_lr: float = ranged(1e-3, gt=0.0, le=1.0)
    sft_batch_size: int = ranged(32, ge=1)
    # steps; 0 disables periodic eval (before/after eval still run)
    eval_every: int = ranged(10, ge=0)
    eval_n_samples: int = ranged(1, ge=1)  # >1 reports pass@k
    save_every: int = ranged(0, ge=0)  # HF export every N steps; 0 = only at the end
    recover_every: int = ranged(10, ge=0)  # resumable state every M steps; 0 disables
    keep_checkpoints: int = ranged(2, ge=1)


@dataclass
class StatsConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "areal"
    wandb_mode: str = "offline"  # offline | online
    live: bool = True  # rich live display
