"""Policy, value and SFT losses, keyed by ``algo.policy_loss``. Pure tensor functions.

Each policy loss returns a per-token loss ``[B, L]`` (zero off ``loss_mask``) plus per-token
diagnostics; :func:`areal_cli.algorithms.normalisation.aggregate_loss` reduces it. Keeping the
reduction separate is what lets every loss work with every ``loss_agg`` mode.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from areal_cli.algorithms.kl import kl_estimate
from areal_cli.algorithms.normalisation import aggregate_loss, masked_mean
from areal_cli.algorithms.registry import POLICY_LOSSES
from areal_cli.config.algo import KL_CLAMP

# exp() of a log-ratio above this overflows float32 long before it means anything.
_MAX_LOG_RATIO = 20.0

PolicyOut = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_clip: float,
                       eps_clip_high: float | None, c_clip: float | None) -> PolicyOut:
    high = eps_clip if eps_clip_high is None else eps_clip_high
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    l1, l2 = -adv * ratio, -adv * clipped
    pg = torch.maximum(l1, l2)
    clip_mask = (l2 > l1).detach() & mask
    if c_clip is not None:
        # Dual clip (Ye et al. 2020): bound the loss of negative-advantage tokens at c * |A|.
        l3 = c_clip * adv.abs()
        dual_mask = (l3 < pg).detach() & mask
        pg = torch.minimum(pg, l3)
    else:
        dual_mask = torch.zeros_like(mask)
    pg = torch.where(mask, pg, torch.zeros_like(pg))
    return pg, {"ratio": ratio.detach(), "clip_mask": clip_mask, "dual_clip_mask": dual_mask}


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, *, eps_clip: float = 0.2, eps_clip_high: float | None = None,
                    c_clip: float | None = None) -> PolicyOut:
    """PPO clip (Schulman et al. 2017) with token ratios, DAPO clip-higher and dual clip."""
    mask = loss_mask.to(torch.bool)
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp)).clamp(max=_MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio), advantages, mask, eps_clip, eps_clip_high, c_clip)


def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     loss_mask: torch.Tensor, *, eps_clip: float = 3e-4, eps_clip_high: float | None = 4e-4,
                     c_clip: float | None = None) -> PolicyOut:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios.

    ``s_i = exp(mean_t(logp - old_logp))`` and the sequence's mean advantage are broadcast to its
    tokens, so with ``seq-mean-token-mean`` the loss is exactly ``-mean_i min(s_i A_i, clip(s_i) A_i)``.
    """
    mask = loss_mask.to(torch.bool)
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).clamp(max=_MAX_LOG_RATIO)
    ratio = torch.exp(seq_log_ratio)[:, None].expand_as(logp)
    seq_adv = masked_mean(advantages, mask, dim=-1)[:, None].expand_as(logp)
    return _clipped_surrogate(ratio, seq_adv, mask, eps_clip, eps_clip_high, c_clip)


def sft_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor | None, advantages: torch.Tensor | None,
                    loss_mask: torch.Tensor) -> PolicyOut:
    """Negative log-likelihood of the trained tokens."""
    mask = loss_mask.to(torch.bool)
    return torch.where(mask, -logp, torch.zeros_like(logp)), {}


def loglinear_prox_logp(behav_logp: torch.Tensor, cur_logp: torch.Tensor, versions: torch.Tensor,
                        current_version: int) -> torch.Tensor:
    """Approximate the proximal policy's logp without a forward pass (AReaL's ``loglinear``).

    The proximal policy is the weights at the start of this step (version ``current_version``);
    the policy being optimised becomes ``current_version + 1``. Interpolating linearly in version
    between a token's behaviour policy ``v_b`` and the current policy gives
    ``alpha = (v_prox - v_b) / (v_theta - v_b)`` and ``prox = behav + alpha * (cur - behav)``.
    On-policy tokens (``v_b == current_version``) get ``alpha = 0``; prompt tokens (``v_b < 0``) too.
    (AReaL's code takes ``v_prox = get_version() - 1, v_theta = get_version()``, i.e. one version
    earlier; both agree on on-policy tokens.)
    """
    v_b = versions.to(torch.float32)
    v_prox, v_theta = float(current_version), float(current_version + 1)
    gap, span = v_prox - v_b, v_theta - v_b
    valid = (versions >= 0) & (span > 0)
    alpha = torch.where(valid, gap / span.clamp(min=1.0), torch.zeros_like(v_b)).clamp(0.0, 1.0)
    behav = behav_logp.float()
    return behav + alpha * (cur_logp.detach().float() - behav)


def behaviour_importance_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor,
                                 cap: float | None = None, mode: str = "truncate",
                                 level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """``w = pi_prox / pi_behav`` correcting for stale or mismatched behaviour samples.

    ``level="sequence"`` uses the geometric mean over the sequence's trained tokens (AReaL's
    semantics). With a ``cap``: ``truncate`` clips ``w`` at ``cap``; ``mask`` drops tokens (or whole
    sequences) whose weight exceeds it. Returns ``(w, kept)``; both are zero off the mask.
    """
    mask = loss_mask.to(torch.bool)
    log_w = torch.where(mask, prox_logp.detach().float() - behav_logp.detach().float(),
                        torch.zeros_like(prox_logp, dtype=torch.float32))
    if level == "sequence":
        log_w = masked_mean(log_w, mask, dim=-1)[:, None].expand_as(log_w)
    elif level != "token":
        raise KeyError(f"unknown behav_imp_weight_level {level!r}; known: token, sequence")
    w = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))
    kept = mask.clone()
    if cap is not None:
        if mode == "truncate":
            w = w.clamp(max=cap)
        elif mode == "mask":
            kept = kept & (w <= cap)
        else:
            raise KeyError(f"unknown behav_imp_weight_mode {mode!r}; known: truncate, mask")
    w = torch.where(kept, w, torch.zeros_like(w))
    return w, kept


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       loss_mask: torch.Tensor, value_clip: float) -> PolicyOut:
    """PPO's clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, ±c) - R)^2)``."""
    mask = loss_mask.to(torch.bool)
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    l1 = (values - returns) ** 2
    l2 = (v_clipped - returns) ** 2
    loss = 0.5 * torch.maximum(l1, l2)
    return torch.where(mask, loss, torch.zeros_like(loss)), {"clip_mask": (l2 > l1).detach() & mask}


@dataclass
class ActorLossParams:
    policy_loss: str = "ppo"
    loss_agg: str = "token-mean"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    c_clip: float | None = None
    use_decoupled_loss: bool = False
    prox_logp_method: str = "recompute"
    behav_imp_weight_cap: float | None = None
    behav_imp_weight_mode: str = "truncate"
    behav_imp_weight_level: str = "token"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    kl_clamp: float = KL_CLAMP  # the one default, shared with AlgoConfig
    loss_agg_norm: float | None = None  # the constant of seq-mean-token-sum-norm
    current_version: int = 0


def _masked_stat(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(x.detach().float(), mask).item())


def actor_loss(logp: torch.Tensor, entropy: torch.Tensor | None, mb: dict[str, torch.Tensor],
               p: ActorLossParams) -> tuple[torch.Tensor, dict[str, float]]:
    """The full actor objective for one micro-batch, reduced with ``p.loss_agg``.

    Ratio denominator: the proximal policy (decoupled loss: recomputed ``prox_logp`` or the
    log-linear approximation), else ``prox_logp`` if it was recomputed, else the behaviour
    ``logprobs``. The behaviour weight ``pi_prox / pi_behav`` multiplies the loss whenever the
    decoupled loss is on, or a cap is set and ``prox_logp`` differs from the behaviour logp.
    """
    mask = mb["loss_mask"].to(torch.bool)
    behav = mb["logprobs"].float() if "logprobs" in mb else logp.detach().float()
    if p.use_decoupled_loss and p.prox_logp_method == "loglinear":
        if "versions" not in mb:
            raise ValueError("prox_logp_method=loglinear needs per-token 'versions' in the batch")
        prox = loglinear_prox_logp(behav, logp, mb["versions"], p.current_version)
    elif p.use_decoupled_loss:
        if "prox_logp" not in mb:
            raise ValueError("decoupled loss with prox_logp_method=recompute needs 'prox_logp' in the batch")
        prox = mb["prox_logp"].float()
    else:
        prox = mb["prox_logp"].float() if "prox_logp" in mb else behav
    adv = mb["advantages"].float() if "advantages" in mb else torch.zeros_like(behav)
    pg, diag = POLICY_LOSSES.call(p.policy_loss, logp=logp, old_logp=prox, advantages=adv, loss_mask=mask,
                                  eps_clip=p.eps_clip, eps_clip_high=p.eps_clip_high, c_clip=p.c_clip)
    stats: dict[str, float] = {}
    if p.use_decoupled_loss or (p.behav_imp_weight_cap is not None and "prox_logp" in mb):
        w, kept = behaviour_importance_weights(prox, behav, mask, p.behav_imp_weight_cap,
                                               p.behav_imp_weight_mode, p.behav_imp_weight_level)
        pg = pg * w
        stats["behav_imp_weight"] = _masked_stat(w, kept)
        stats["behav_kept_frac"] = _masked_stat(kept.float(), mask)
        stats["behav_approx_kl"] = _masked_stat(prox - behav, mask)
    token_loss = pg
    # The KL-to-reference penalty belongs to RL objectives, not to a loss without advantages (sft).
    if p.kl_coef > 0 and not p.kl_in_reward and POLICY_LOSSES.spec(p.policy_loss).uses_advantages:
        if "ref_logp" not in mb:
            raise ValueError("kl_coef > 0 with the KL in the loss needs 'ref_logp' in the batch")
        kl = kl_estimate(logp, mb["ref_logp"], p.kl_estimator, clamp=p.kl_clamp, mask=mask)
        token_loss = token_loss + p.kl_coef * kl
        stats["kl"] = _masked_stat(kl, mask)
    if p.entropy_coef != 0.0 and entropy is not None:
        token_loss = token_loss - p.entropy_coef * torch.where(mask, entropy, torch.zeros_like(entropy))
    loss = aggregate_loss(token_loss, mask, p.loss_agg, p.loss_agg_norm)
    stats["pg_loss"] = float(aggregate_loss(pg.detach(), mask, p.loss_agg, p.loss_agg_norm).item())
    if entropy is not None:
        stats["entropy"] = _masked_stat(entropy, mask)
    if "ratio" in diag:
        stats["importance_ratio"] = _masked_stat(diag["ratio"], mask)
        stats["clip_frac"] = _masked_stat(diag["clip_mask"].float(), mask)
        stats["dual_clip_frac"] = _masked_stat(diag["dual_clip_mask"].float(), mask)
        stats["approx_kl"] = _masked_stat(logp - prox, mask)
    stats["n_tokens"] = float(mask.sum().item())
    return loss, stats
