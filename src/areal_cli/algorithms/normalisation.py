"""Masked statistics, group views and loss aggregation. Pure tensor functions (no distributed).

Loss aggregation must agree with the engine's global normalisation: a micro-batch loss is a mean
over that micro-batch's *units* and :func:`count_units` returns the same number of units, which the
engine uses as ``loss_weight_fn``. Summing ``loss * units / global_units`` over micro-batches then
equals the aggregation over the whole batch, however it was split.
"""

from __future__ import annotations

from typing import Callable

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over ``mask``; 0 where nothing is masked in (instead of NaN)."""
    m = mask.to(x.dtype)
    denom = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / denom.clamp(min=1.0)


# Sums a tensor over data-parallel ranks (e.g. an all-reduce built by the trainer from the engine's
# dp_group). None means the batch at hand is the whole batch. Keeps this module free of
# torch.distributed while letting batch-level statistics be global.
Reducer = Callable[[torch.Tensor], torch.Tensor]


def masked_moments(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
                   reduce: Reducer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) of the masked entries, in float64, optionally over all DP ranks.

    One reduction of (sum, sum of squares, count); the variance is Bessel-corrected like verl's
    ``masked_var`` when ``unbiased``.
    """
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    stats = torch.stack([(xd * m).sum(), (xd * xd * m).sum(), m.sum()])
    if reduce is not None:
        stats = reduce(stats)
    s, ss, n = stats.unbind()
    n_safe = n.clamp(min=1.0)
    mean = s / n_safe
    var = (ss / n_safe - mean * mean).clamp(min=0.0)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return mean, var


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
               reduce: Reducer | None = None) -> torch.Tensor:
    return masked_moments(x, mask, unbiased, reduce)[1].to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = True,
                  eps: float = 1e-8, reduce: Reducer | None = None) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked entries; masked-out entries become 0."""
    mean, var = masked_moments(x, mask, unbiased, reduce)
    out = (x.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * mask.to(torch.float64)).to(x.dtype)


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` → ``[B // group_size, group_size]``; consecutive rows form a group."""
    if group_size < 1 or x.shape[0] % group_size != 0:
        raise ValueError(f"batch of {x.shape[0]} sequences is not a whole number of groups of "
                         f"{group_size} (rollout.group_size); groups must stay together in a batch")
    return x.view(-1, group_size, *x.shape[1:])


def seq_has_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: sequences with at least one trained token (the unit of the seq-mean modes)."""
    return loss_mask.to(torch.bool).any(dim=-1)


# --- loss aggregation --------------------------------------------------------------------------

def token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(loss, mask) / mask.to(loss.dtype).sum().clamp(min=1.0)


def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_seq = masked_sum(loss, mask, dim=-1)
    n_seq = seq_has_tokens(mask).to(loss.dtype).sum().clamp(min=1.0)
    return per_seq.sum() / n_seq


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_seq = masked_mean(loss, mask, dim=-1)  # 0 for sequences without tokens
    n_seq = seq_has_tokens(mask).to(loss.dtype).sum().clamp(min=1.0)
    return per_seq.sum() / n_seq


def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: float) -> torch.Tensor:
    # verl's seq-mean-token-sum-norm and the Dr.GRPO authors' constant_normalizer: a sequence's token
    # sum over a constant (the generation budget), not over its own length, so long and short
    # responses weigh each token alike.
    return seq_mean_token_sum(loss, mask) / norm


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str,
                   norm: float | None = None) -> torch.Tensor:
    """Reduce a per-token ``[B, L]`` loss to a scalar: a mean over this batch's units.

    ``norm`` is the constant of ``seq-mean-token-sum-norm`` (the trainer passes
    ``rollout.gconfig.max_new_tokens``); other modes ignore it."""
    from areal_cli.algorithms.registry import LOSS_AGG

    if LOSS_AGG.spec(mode).needs_norm:
        if norm is None or not norm > 0:
            raise ValueError(f"loss_agg={mode} needs a positive constant norm (the generation budget), "
                             f"got {norm!r}")
        return LOSS_AGG.call(mode, loss=loss, mask=mask, norm=float(norm))
    return LOSS_AGG.call(mode, loss=loss, mask=mask)


def count_units(mask: torch.Tensor, mode: str) -> float:
    """Number of units the aggregation averages over: tokens for token-mean, sequences otherwise."""
    from areal_cli.algorithms.registry import LOSS_AGG

    if LOSS_AGG.spec(mode).unit == "token":
        return float(mask.to(torch.bool).sum().item())
    return float(seq_has_tokens(mask).sum().item())
