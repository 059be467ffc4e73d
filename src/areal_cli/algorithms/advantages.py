"""Advantage estimators, keyed by ``algo.adv_estimator`` (declared in algorithms/registry.py). Pure
tensor functions.

Inputs follow the engine's batch format: ``rewards`` [B] (one scalar per sequence), ``loss_mask``
[B, L] (1 on generated tokens that are trained), optional ``token_rewards`` [B, L] (per-token
shaping such as the KL-in-reward penalty, already zero off the mask) and ``values`` [B, L]. Groups
are ``group_size`` consecutive rows (the samples of one prompt). Every estimator returns
``(advantages [B, L], returns [B, L] | None)`` with zeros off the mask.

Groups: by default ``group_size`` consecutive rows. A batch whose ``group_id`` [B] does not form such
blocks (agent episodes export a varying number of rows, ``rollout/workflows/agent.py``) is grouped
by ``group_id`` instead: a group is every row with the same id, whatever its size and position.

Outcome estimators (grpo, drgrpo, rloo, reinforce_pp_baseline, none) score a sequence by
``rewards + sum_t token_rewards`` (verl sums token-level rewards the same way); token-level ones
(reinforce_pp, gae) place ``rewards`` on the last trained token of each sequence.
"""

from __future__ import annotations

import torch

from areal_cli.algorithms.normalisation import Reducer, group_view, masked_moments, masked_whiten

AdvOut = tuple[torch.Tensor, "torch.Tensor | None"]


def sequence_scores(rewards: torch.Tensor, loss_mask: torch.Tensor,
                    token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    scores = rewards.float()
    if token_rewards is not None:
        scores = scores + (token_rewards.float() * loss_mask.float()).sum(-1)
    return scores


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last trained token per row (0 for rows without any)."""
    L = loss_mask.shape[-1]
    has = loss_mask.to(torch.bool).any(dim=-1)
    flipped = loss_mask.to(torch.bool).flip(-1).to(torch.int8)
    idx = L - 1 - flipped.argmax(dim=-1)
    return torch.where(has, idx, torch.zeros_like(idx))


def token_level_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor,
                        token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """``token_rewards`` plus each sequence's scalar reward on its last trained token."""
    mask = loss_mask.float()
    out = torch.zeros_like(mask) if token_rewards is None else token_rewards.float() * mask
    has = mask.sum(-1) > 0
    idx = last_token_index(loss_mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    out[rows[has], idx[has]] += rewards.float()[has]
    return out


def group_index(group_ids: torch.Tensor | None, rows: int, group_size: int) -> torch.Tensor | None:
    """``None`` when rows form consecutive groups of ``group_size`` (each block one id, or no ids);
    else each row's group as an index ``[B]`` into ``0..G-1``, from ``group_ids``."""
    if group_ids is None:
        return None
    ids = group_ids.reshape(-1)
    if rows % group_size == 0:
        blocks = ids.view(-1, group_size)
        if bool((blocks == blocks[:, :1]).all()):
            return None
    return torch.unique(ids, return_inverse=True)[1]


def _by_id_moments(x: torch.Tensor, inv: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and std of the row's group (a group of one has std 0)."""
    g = int(inv.max().item()) + 1 if inv.numel() else 0
    cnt = torch.bincount(inv, minlength=g).to(x.dtype)
    mean = torch.zeros(g, dtype=x.dtype, device=x.device).index_add_(0, inv, x) / cnt
    dev = (x - mean[inv]) ** 2
    ss = torch.zeros(g, dtype=x.dtype, device=x.device).index_add_(0, inv, dev)
    denom = (cnt - (1 if unbiased else 0)).clamp(min=1)
    std = torch.where(cnt > 1, (ss / denom).sqrt(), torch.zeros_like(ss))
    return mean[inv], std[inv]


def _level_mean(x: torch.Tensor, level: str, group_size: int, reduce: Reducer | None = None,
                inv: torch.Tensor | None = None) -> torch.Tensor:
    if level == "group" and inv is not None:
        return _by_id_moments(x, inv, True)[0]
    if level == "group":
        return group_view(x, group_size).mean(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
    if level == "batch":
        return masked_moments(x, torch.ones_like(x), reduce=reduce)[0].to(x.dtype).expand_as(x)
    if level == "none":
        return torch.zeros_like(x)
    raise KeyError(f"unknown mean_level {level!r}; known: group, batch, none")


def _std(x: torch.Tensor, unbiased: bool, dim: int | None = None) -> torch.Tensor:
    corr = 1 if unbiased else 0
    if dim is None:
        return x.std(correction=corr) if x.numel() >= 2 else x.new_zeros(())
    if x.shape[dim] < 2:  # a single sample has no spread
        return x.new_zeros(x.mean(dim=dim, keepdim=True).shape)
    return x.std(dim=dim, correction=corr, keepdim=True)


def _level_std(x: torch.Tensor, level: str, group_size: int, unbiased: bool,
               reduce: Reducer | None = None, inv: torch.Tensor | None = None) -> torch.Tensor | None:
    if level == "group" and inv is not None:
        return _by_id_moments(x, inv, unbiased)[1]
    if level == "group":
        return _std(group_view(x, group_size), unbiased, dim=1).expand(-1, group_size).reshape(-1)
    if level == "batch":
        if reduce is None:
            return _std(x, unbiased).expand_as(x)
        return masked_moments(x, torch.ones_like(x), unbiased, reduce)[1].sqrt().to(x.dtype).expand_as(x)
    if level == "none":
        return None
    raise KeyError(f"unknown std_level {level!r}; known: group, batch, none")


def grpo_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor, group_size: int,
                    token_rewards: torch.Tensor | None = None, mean_level: str = "group",
                    std_level: str = "group", std_unbiased: bool = True, eps: float = 1e-6,
                    reduce: Reducer | None = None, group_ids: torch.Tensor | None = None) -> AdvOut:
    """GRPO (Shao et al. 2024): ``(r - mean) / (std + eps)`` with each statistic at its level.

    ``reduce`` (sum over data-parallel ranks) makes the ``batch`` levels global. The statistics run
    in float64 on the float32 scores: a sum of up to 2**29 equal float32 values is exact there, so
    the mean of an all-equal group (or batch) is that value exactly and its advantages are exactly
    0. In float32 the mean can be a rounding step off, and dividing that residue by a std of ~1e-8
    plus eps gave |A| up to ~0.8 for rewards that carry no signal."""
    r = sequence_scores(rewards, loss_mask, token_rewards).double()
    inv = group_index(group_ids, r.shape[0], group_size)
    adv = r - _level_mean(r, mean_level, group_size, reduce, inv)
    std = _level_std(r, std_level, group_size, std_unbiased, reduce, inv)
    if std is not None:
        adv = adv / (std + eps)
    return adv.float()[:, None] * loss_mask.float(), None


def drgrpo_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor, group_size: int,
                      token_rewards: torch.Tensor | None = None, group_ids: torch.Tensor | None = None) -> AdvOut:
    """Dr.GRPO (Liu et al. 2025): group mean baseline, no std division."""
    return grpo_advantages(rewards=rewards, loss_mask=loss_mask, group_size=group_size,
                           token_rewards=token_rewards, mean_level="group", std_level="none",
                           group_ids=group_ids)


def rloo_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor, group_size: int,
                    token_rewards: torch.Tensor | None = None, group_ids: torch.Tensor | None = None) -> AdvOut:
    """RLOO (Ahmadian et al. 2024): baseline is the mean of the *other* samples of the prompt.
    Grouped by id, a group of one row has no baseline and gets advantage 0."""
    inv = group_index(group_ids, rewards.shape[0], max(group_size, 1))
    if inv is not None:
        r = sequence_scores(rewards, loss_mask, token_rewards).double()
        g = int(inv.max().item()) + 1
        cnt = torch.bincount(inv, minlength=g).double()
        tot = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, r)
        n = cnt[inv]
        loo = torch.where(n > 1, (tot[inv] - r) / (n - 1).clamp(min=1), r)
        return (r - loo).float()[:, None] * loss_mask.float(), None
    if group_size < 2:
        raise ValueError("rloo needs rollout.group_size >= 2 (the baseline leaves one sample out)")
    # float64: the leave-one-out mean of an all-equal group is then exactly that value (see grpo).
    r = group_view(sequence_scores(rewards, loss_mask, token_rewards).double(), group_size)
    loo_mean = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - loo_mean).float().reshape(-1)[:, None] * loss_mask.float(), None


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` over trained tokens; untrained tokens are skipped (carried)."""
    mask = loss_mask.float()
    B, L = mask.shape
    running = torch.zeros(B, dtype=torch.float32, device=mask.device)
    out = torch.zeros_like(mask)
    for t in reversed(range(L)):
        m = mask[:, t]
        new = token_rewards[:, t].float() + gamma * running
        running = m * new + (1 - m) * running
        out[:, t] = m * new
    return out


def reinforce_pp_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor,
                            token_rewards: torch.Tensor | None = None, gamma: float = 1.0,
                            reduce: Reducer | None = None) -> AdvOut:
    """REINFORCE++ (Hu 2025): token-level discounted returns (KL in the reward), whitened over the batch."""
    returns = discounted_returns(token_level_rewards(rewards, loss_mask, token_rewards), loss_mask, gamma)
    return masked_whiten(returns, loss_mask, reduce=reduce), returns


def reinforce_pp_baseline_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor, group_size: int,
                                     token_rewards: torch.Tensor | None = None,
                                     reduce: Reducer | None = None, group_ids: torch.Tensor | None = None) -> AdvOut:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch's tokens."""
    r = sequence_scores(rewards, loss_mask, token_rewards).double()  # exact zeros for equal groups
    inv = group_index(group_ids, r.shape[0], group_size)
    r = (r - _level_mean(r, "group", group_size, inv=inv)).float()
    return masked_whiten(r[:, None] * loss_mask.float(), loss_mask, reduce=reduce), None


def gae_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor, values: torch.Tensor | None = None,
                   token_rewards: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0) -> AdvOut:
    """GAE (Schulman et al. 2016) over trained tokens; the state after the last token has value 0.

    ``values[:, t]`` is V of the state before token ``t`` (the position convention), so
    ``delta_t = r_t + gamma * V_next - V_t`` where ``V_next`` is the value at the next trained token.
    """
    if values is None:
        raise ValueError("adv_estimator=gae needs 'values' in the batch (run PPOCritic.compute_values first)")
    mask = loss_mask.float()
    r = token_level_rewards(rewards, loss_mask, token_rewards)
    v = values.float()
    B, L = mask.shape
    next_v = torch.zeros(B, dtype=torch.float32, device=mask.device)
    last_gae = torch.zeros_like(next_v)
    adv = torch.zeros_like(mask)
    for t in reversed(range(L)):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        new_gae = delta + gamma * lam * last_gae
        last_gae = m * new_gae + (1 - m) * last_gae
        next_v = m * v[:, t] + (1 - m) * next_v
        adv[:, t] = m * new_gae
    return adv, (adv + v) * mask


def no_baseline_advantages(*, rewards: torch.Tensor, loss_mask: torch.Tensor,
                           token_rewards: torch.Tensor | None = None) -> AdvOut:
    """Plain REINFORCE: the sequence score itself, on every trained token."""
    return sequence_scores(rewards, loss_mask, token_rewards)[:, None] * loss_mask.float(), None


def compute_advantages(estimator: str, **inputs) -> AdvOut:
    """Run the estimator registered as ``estimator`` (algorithms/registry.py) on the inputs it names.
    An input outside ``registry.ESTIMATOR_INPUTS`` is a TypeError, not silently dropped."""
    from areal_cli.algorithms.registry import ADV_ESTIMATORS

    with torch.no_grad():
        return ADV_ESTIMATORS.call(estimator, **inputs)


def longest_turn_len(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` length of each row's longest run of consecutive trained tokens: one turn's response.

    ``max_new_tokens`` bounds each generation call, and multi-turn rows separate their turns with
    untrained context tokens (feedback, chat template), so the longest run is the turn that came
    closest to the limit. A single-turn row has one run: its response length."""
    m = loss_mask.to(torch.bool).to(torch.long)
    count = m.cumsum(-1)
    at_last_gap = torch.where(m == 0, count, torch.zeros_like(count)).cummax(-1).values
    return (count - at_last_gap).max(-1).values if m.shape[-1] else m.sum(-1)


def overlong_penalty(response_lens: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward.

    0 up to ``max_new_tokens - buffer_len`` tokens, then linear down to ``-factor`` at
    ``max_new_tokens``; ``-factor`` beyond.
    """
    if buffer_len <= 0 or buffer_len > max_new_tokens:
        raise ValueError(f"overlong buffer ({buffer_len}) must be in [1, max_new_tokens={max_new_tokens}]")
    expected = max_new_tokens - buffer_len
    exceed = response_lens.float() - expected
    return (-exceed / buffer_len * factor).clamp(min=-factor, max=0.0)
