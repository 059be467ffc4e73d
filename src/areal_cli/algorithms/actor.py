"""Actor glue: logprobs, reference logprobs and advantages, then PPO mini-batch updates.

The trainer calls, per step (critic only for ``use_critic``)::

    batch = critic.compute_values(batch)          # PPOCritic, adds "values"
    batch = actor.compute_advantages(batch)       # adds prox_logp/ref_logp/advantages/returns
    stats = actor.ppo_update(batch)               # ppo_n_minibatches optimiser steps
    stats |= critic.ppo_update(batch)

For ``algo=sft`` it calls :func:`sft_step` instead.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from areal_cli.algorithms.advantages import (compute_advantages as _estimate, longest_turn_len,
                                             overlong_penalty)
from areal_cli.algorithms.distill import distill_advantages, mix_advantages
from areal_cli.algorithms.kl import kl_reward
from areal_cli.algorithms.losses import ActorLossParams, actor_loss, sft_policy_loss
from areal_cli.algorithms.normalisation import (
    Reducer,
    aggregate_loss,
    count_units,
    masked_mean,
    masked_whiten,
)
from areal_cli.algorithms.registry import ADV_ESTIMATORS, LOSS_AGG
from areal_cli.config.algo import AlgoConfig
from areal_cli.algorithms.config_checks import validate_algo_config
from areal_cli.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.engine_api import TrainEngine

Batch = dict[str, torch.Tensor]


def split_minibatches(batch: Batch, n: int) -> list[Batch]:
    """Split every ``[B, ...]`` tensor into ``n`` contiguous, near-equal chunks along dim 0."""
    B = int(batch["input_ids"].shape[0])
    if n > B:
        raise ConfigError("algo.ppo_n_minibatches", f"{n} mini-batches for a batch of {B} sequences",
                          f"set algo.ppo_n_minibatches <= {B}")
    idx = torch.tensor_split(torch.arange(B), n)
    out = []
    for chunk in idx:
        lo, hi = int(chunk[0]), int(chunk[-1]) + 1
        # per-row lists (multi_modal: each row's images) are cut with their rows
        out.append({k: (v[lo:hi] if (torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == B)
                        or (isinstance(v, list) and len(v) == B) else v)
                    for k, v in batch.items()})
    return out


def mean_stats(all_stats: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for s in all_stats for k in s}
    return {k: float(sum(s[k] for s in all_stats if k in s) / sum(1 for s in all_stats if k in s))
            for k in sorted(keys)}


def overlong_buffer(cfg: AlgoConfig, max_new_tokens: int | None) -> int:
    """The DAPO buffer in tokens (0 = off), from ``overlong_buffer_len`` or the ratio."""
    if cfg.overlong_buffer_len <= 0 and cfg.overlong_buffer_ratio <= 0:
        return 0
    if max_new_tokens is None:
        raise ConfigError("algo.overlong_buffer_len", "the overlong penalty needs the generation budget",
                          "pass max_new_tokens=rollout.gconfig.max_new_tokens to PPOActor")
    buf = cfg.overlong_buffer_len or max(1, int(round(cfg.overlong_buffer_ratio * max_new_tokens)))
    if buf > max_new_tokens:
        raise ConfigError("algo.overlong_buffer_len", f"buffer of {buf} tokens exceeds "
                          f"rollout.gconfig.max_new_tokens={max_new_tokens}",
                          "use a smaller buffer or algo.overlong_buffer_ratio=0.2")
    return buf


def loss_agg_norm(cfg: AlgoConfig, max_new_tokens: int | None) -> float | None:
    """The constant of ``loss_agg=seq-mean-token-sum-norm``: the generation budget (None otherwise)."""
    if not LOSS_AGG.spec(cfg.loss_agg).needs_norm:
        return None
    if max_new_tokens is None:
        raise ConfigError("algo.loss_agg", f"loss_agg={cfg.loss_agg} divides by the generation budget",
                          "pass max_new_tokens=rollout.gconfig.max_new_tokens to PPOActor")
    return float(max_new_tokens)


class PPOActor:
    """Drives a policy ``TrainEngine`` through one PPO-family training step."""

    def __init__(self, cfg: AlgoConfig, engine: "TrainEngine", ref_engine: "TrainEngine | None" = None,
                 group_size: int = 1, max_new_tokens: int | None = None,
                 dp_allreduce: "Reducer | None" = None, teacher_engine: "TrainEngine | None" = None):
        """``dp_allreduce(t) -> t`` sums a tensor over data-parallel ranks; pass it when each rank
        holds a shard of the step's batch so batch-level statistics (``mean_level``/``std_level``
        = batch, REINFORCE++ whitening, ``adv_norm``) are global. Groups must not straddle ranks.
        ``teacher_engine``: the frozen teacher of on-policy distillation (``algo.distill``)."""
        validate_algo_config(cfg)
        if cfg.kl_coef > 0 and ref_engine is None:
            raise ConfigError("algo.kl_coef", f"kl_coef={cfg.kl_coef} needs a reference model",
                              "build a ref engine (the trainer does when kl_coef > 0) or set algo.kl_coef=0")
        if cfg.distill.enabled and teacher_engine is None:
            raise ConfigError("algo.distill.teacher_path", "distillation needs a teacher engine",
                              "build one (the trainer does when algo.distill.teacher_path is set)")
        self.cfg = cfg
        self.engine = engine
        self.ref_engine = ref_engine
        self.teacher_engine = teacher_engine
        self.group_size = int(group_size)
        self.max_new_tokens = max_new_tokens
        self.dp_allreduce = dp_allreduce
        self.overlong_buffer = overlong_buffer(cfg, max_new_tokens)
        self.loss_agg_norm = loss_agg_norm(cfg, max_new_tokens)

    @property
    def recomputes_logp(self) -> bool:
        c = self.cfg
        return (c.use_decoupled_loss and c.prox_logp_method == "recompute") or c.recompute_logprob

    @torch.no_grad()
    def compute_logp(self, batch: Batch, engine: "TrainEngine | None" = None) -> torch.Tensor:
        out = (engine or self.engine).forward(batch, output="logprobs", temperature=self.cfg.temperature)
        return out["logprobs"].float() * batch["loss_mask"].float()

    def _shaped_rewards(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        r = batch["rewards"].float()
        stats: dict[str, float] = {}
        if self.overlong_buffer > 0:
            assert self.max_new_tokens is not None
            # Per turn: max_new_tokens bounds each generation, not a multi-turn row's sum of turns.
            lens = longest_turn_len(batch["loss_mask"])
            pen = overlong_penalty(lens, self.max_new_tokens, self.overlong_buffer, c.overlong_penalty_factor)
            r = r + pen
            stats["overlong_penalty"] = float(pen.mean().item())
        r = ((r + c.reward_bias) * c.reward_scaling).clamp(-c.reward_clip, c.reward_clip)
        return r, stats

    @torch.no_grad()
    def compute_advantages(self, batch: Batch) -> Batch:
        """Return a copy of ``batch`` with ``advantages`` (and ``prox_logp``, ``ref_logp``,
        ``returns``, ``shaped_rewards`` where they apply). Stats land in ``self.adv_stats``."""
        c = self.cfg
        batch = dict(batch)
        mask = batch["loss_mask"].float()
        if self.recomputes_logp:
            batch["prox_logp"] = self.compute_logp(batch)
        if c.kl_coef > 0:
            batch["ref_logp"] = self.compute_logp(batch, engine=self.ref_engine)
        if c.distill.enabled:
            batch["teacher_logp"] = self.compute_logp(batch, engine=self.teacher_engine)
        rewards, stats = self._shaped_rewards(batch)
        # Per-turn rewards of agent rows (rollout/interaction_cache.py) sit on each turn's last token.
        token_rewards = batch["token_rewards"].float() * mask if "token_rewards" in batch else None
        if c.kl_coef > 0 and c.kl_in_reward:
            old = batch.get("prox_logp", batch["logprobs"])
            kl = kl_reward(old, batch["ref_logp"], mask, c.kl_coef, c.kl_estimator, c.kl_clamp)
            stats["kl_reward"] = float((kl.sum(-1)).mean().item())
            token_rewards = kl if token_rewards is None else token_rewards + kl
        if ADV_ESTIMATORS.spec(c.adv_estimator).needs_values and "values" not in batch:
            raise ValueError(f"adv_estimator={c.adv_estimator} reads values: call PPOCritic.compute_values(batch) "
                             "before compute_advantages")
        adv, returns = _estimate(c.adv_estimator, rewards=rewards, loss_mask=mask, group_size=self.group_size,
                                 token_rewards=token_rewards, values=batch.get("values"), gamma=c.gamma,
                                 lam=c.lam, mean_level=c.mean_level, std_level=c.std_level,
                                 std_unbiased=c.std_unbiased, eps=c.adv_std_eps, reduce=self.dp_allreduce,
                                 group_ids=batch.get("group_id"))
        if c.distill.enabled:  # before adv_norm, which then whitens what is trained on (a baseline for it)
            adv = self._distill(batch, adv, mask, stats)
        if c.adv_norm:
            adv = masked_whiten(adv, mask, reduce=self.dp_allreduce)
        batch["advantages"] = adv
        batch["shaped_rewards"] = rewards
        if returns is not None:
            batch["returns"] = returns
        stats.update(reward_mean=float(batch["rewards"].float().mean().item()),
                     shaped_reward_mean=float(rewards.mean().item()),
                     adv_mean=float(masked_mean(adv, mask).item()),
                     adv_abs_mean=float(masked_mean(adv.abs(), mask).item()),
                     response_len=float(mask.sum(-1).mean().item()))
        self.adv_stats = stats
        return batch

    def _distill(self, batch: Batch, task_adv: torch.Tensor, mask: torch.Tensor,
                 stats: dict[str, float]) -> torch.Tensor:
        """The teacher's per-token advantage, mixed with the task's (``algo.distill``).

        The student's logp is the trainer's recomputed one when the run recomputes it (decoupled loss,
        ``recompute_logprob``: teacher and student then come from the same numerics, no inference/trainer
        mismatch in the difference), else the behaviour logprobs the tokens were sampled with — the policy
        whose reverse KL the sample estimates, and what Tinker's recipe uses. Both carry no gradient: the
        advantage is a reward, and the PPO ratio carries the gradient."""
        d = self.cfg.distill
        student = batch.get("prox_logp", batch["logprobs"])
        dadv, dstats = distill_advantages(batch["teacher_logp"], student, mask, d.coef, d.clamp)
        stats.update(dstats)
        stats["distill/task_adv_abs_mean"] = float(masked_mean(task_adv.abs(), mask).item())
        return mix_advantages(task_adv, dadv, mask, d.task_reward_weight)

    def loss_params(self) -> ActorLossParams:
        c = self.cfg
        fields = {k: v for k, v in asdict(c).items() if k in ActorLossParams.__dataclass_fields__}
        return ActorLossParams(**fields, loss_agg_norm=self.loss_agg_norm,
                               current_version=self.engine.get_version())

    def loss_fn(self, params: ActorLossParams):
        def fn(outputs: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            return actor_loss(outputs["logprobs"], outputs.get("entropy"), mb, params)
        return fn

    def loss_weight_fn(self, mb: Batch) -> float:
        return count_units(mb["loss_mask"], self.cfg.loss_agg)

    def ppo_update(self, batch: Batch) -> dict[str, float]:
        """``ppo_n_minibatches`` optimiser steps over contiguous slices of ``batch``."""
        if "advantages" not in batch:
            raise ValueError("ppo_update needs 'advantages': call compute_advantages(batch) first")
        loss_fn = self.loss_fn(self.loss_params())
        per_mb: list[dict[str, float]] = []
        for mb in split_minibatches(batch, self.cfg.ppo_n_minibatches):
            per_mb.append(dict(self.engine.train_batch(mb, loss_fn, self.loss_weight_fn,
                                                        temperature=self.cfg.temperature)))
        stats = mean_stats(per_mb)
        stats.update(getattr(self, "adv_stats", {}))
        stats["n_minibatches"] = float(len(per_mb))
        return stats


class SFTLoss:
    """Token NLL with the aggregation the engine's global normalisation expects."""

    def __init__(self, loss_agg: str = "token-mean"):
        self.loss_agg = loss_agg

    def loss_fn(self, outputs: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["loss_mask"].to(torch.bool)
        nll, _ = sft_policy_loss(outputs["logprobs"], None, None, mask)
        loss = aggregate_loss(nll, mask, self.loss_agg)
        tok_nll = float(masked_mean(nll.detach(), mask).item())
        return loss, {"nll": tok_nll, "ppl": float(torch.exp(torch.tensor(min(tok_nll, 50.0))).item()),
                      "n_tokens": float(mask.sum().item())}

    def loss_weight_fn(self, mb: Batch) -> float:
        return count_units(mb["loss_mask"], self.loss_agg)


def sft_step(engine: "TrainEngine", batch: Batch, loss_agg: str = "token-mean") -> dict[str, Any]:
    """One optimiser step of supervised fine-tuning on ``batch`` (``loss_mask`` marks targets)."""
    loss = SFTLoss(loss_agg)
    return dict(engine.train_batch(batch, loss.loss_fn, loss.loss_weight_fn))
