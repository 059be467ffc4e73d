"""Critic glue for PPO with GAE: value prediction and clipped value-loss updates."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areal_cli.algorithms.actor import mean_stats, split_minibatches
from areal_cli.algorithms.losses import clipped_value_loss
from areal_cli.algorithms.normalisation import aggregate_loss, count_units, masked_mean
from areal_cli.config.algo import AlgoConfig

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.engine_api import TrainEngine

Batch = dict[str, torch.Tensor]


class PPOCritic:
    """Drives a value-model ``TrainEngine`` (``forward(output="values")``). The engine's optimiser
    should use ``algo.critic_lr``."""

    def __init__(self, cfg: AlgoConfig, engine: "TrainEngine"):
        self.cfg = cfg
        self.engine = engine

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Return a copy of ``batch`` with ``values`` ([B, L], zero off the loss mask)."""
        batch = dict(batch)
        values = self.engine.forward(batch, output="values")["values"].float()
        batch["values"] = values * batch["loss_mask"].float()
        return batch

    def loss_fn(self, outputs: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["loss_mask"].to(torch.bool)
        v = outputs["values"].float()
        loss_tok, diag = clipped_value_loss(v, mb["values"].float(), mb["returns"].float(), mask,
                                            self.cfg.value_clip)
        loss = aggregate_loss(loss_tok, mask, "token-mean")
        return loss, {"value_loss": float(loss.detach().item()),
                      "value_clip_frac": float(masked_mean(diag["clip_mask"].float(), mask).item()),
                      "value_mean": float(masked_mean(v.detach(), mask).item()),
                      "returns_mean": float(masked_mean(mb["returns"].float(), mask).item())}

    @staticmethod
    def loss_weight_fn(mb: Batch) -> float:
        return count_units(mb["loss_mask"], "token-mean")

    def ppo_update(self, batch: Batch) -> dict[str, float]:
        for key in ("values", "returns"):
            if key not in batch:
                raise ValueError(f"critic update needs {key!r}: call compute_values and the actor's "
                                 "compute_advantages (adv_estimator=gae) first")
        per_mb = [dict(self.engine.train_batch(mb, self.loss_fn, self.loss_weight_fn))
                  for mb in split_minibatches(batch, self.cfg.ppo_n_minibatches)]
        return {f"critic/{k}": v for k, v in mean_stats(per_mb).items()}
