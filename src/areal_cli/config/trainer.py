"""``trainer`` and ``stats`` sections: loop length, evaluation, checkpoints, logging."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerConfig:
    total_steps: int = 40
    total_epochs: int | None = None  # None → total_steps decides
    sft_warmup_steps: int = 0  # >0: run SFT for this many steps before RL, in the same command
    sft_lr: float = 1e-3
    sft_batch_size: int = 32
    eval_every: int = 10  # steps; 0 disables periodic eval (before/after eval still run)
    eval_n_samples: int = 1  # >1 reports pass@k
    save_every: int = 0  # HF export every N steps; 0 = only at the end
    recover_every: int = 10  # resumable state every M steps; 0 disables
    keep_checkpoints: int = 2


@dataclass
class StatsConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "areal"
    wandb_mode: str = "offline"  # offline | online
    live: bool = True  # rich live display
