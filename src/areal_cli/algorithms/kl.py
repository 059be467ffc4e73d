"""KL estimators between the policy and a reference policy, from per-token logprobs.

With ``log_ratio = logp - ref_logp`` (token sampled from the policy), Schulman's estimators of
KL(policy || ref) are: k1 = log_ratio, k2 = log_ratio**2 / 2, k3 = exp(-log_ratio) - 1 + log_ratio.
k1 is unbiased with high variance; k3 is unbiased, non-negative and low-variance (GRPO's choice);
k2's gradient equals the gradient of the true KL for on-policy samples.
"""

from __future__ import annotations

import torch

from areal_cli.algorithms.registry import KL_ESTIMATORS
from areal_cli.config.algo import KL_CLAMP


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - 1.0 - log_ratio


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float = KL_CLAMP,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate clamped to ``[-clamp, clamp]`` (every estimator; ``clamp=0`` disables) and
    zeroed outside ``mask``."""
    kl = KL_ESTIMATORS.call(estimator, logp=logp.float(), ref_logp=ref_logp.float())
    if clamp and clamp > 0:
        kl = kl.clamp(min=-clamp, max=clamp)
    if mask is not None:
        kl = kl * mask.to(kl.dtype)
    return kl


def kl_reward(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor, kl_coef: float,
              estimator: str, clamp: float = KL_CLAMP) -> torch.Tensor:
    """Per-token reward ``-kl_coef * KL`` for KL-in-reward (no gradient)."""
    with torch.no_grad():
        return -kl_coef * kl_estimate(logp, ref_logp, estimator, clamp=clamp, mask=loss_mask)
