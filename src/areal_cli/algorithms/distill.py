"""On-policy distillation: a frozen teacher's logprobs on the student's own samples as a per-token advantage.

The student samples a completion; the teacher scores every sampled token. The per-token reverse KL
``KL(student || teacher)`` at a sampled token is estimated by ``student_logp - teacher_logp`` (the k1
estimator), so its negation, ``teacher_logp - student_logp``, is a per-token reward: positive where the
teacher likes the student's choice more than the student does. As in AReaL's and Tinker's on-policy
distillation it is used with discount 0: token ``t``'s advantage is its own reward only, not a sum over the
tokens after it (each token gets dense feedback; a return would add the noise of every later token).

The PPO/GRPO loss then consumes the advantage unchanged (clip, importance weights, aggregation).
"""

from __future__ import annotations

import torch

from areal_cli.algorithms.normalisation import masked_mean


def distill_advantages(teacher_logp: torch.Tensor, student_logp: torch.Tensor, loss_mask: torch.Tensor,
                       coef: float = 1.0, clamp: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """``coef * (teacher_logp - student_logp)`` on loss positions (0 elsewhere), the difference clamped to
    ``[-clamp, clamp]`` first (``clamp=0``: not clamped), and its stats: ``distill/reverse_kl`` (the mean
    per-token k1 estimate of KL(student || teacher) over loss positions, unclamped),
    ``distill/teacher_logp`` and ``distill/student_logp`` (their means there) and ``distill/adv_abs_mean``."""
    mask = loss_mask.float()
    diff = (teacher_logp.float() - student_logp.float()) * mask
    raw = diff
    if clamp and clamp > 0:
        diff = diff.clamp(min=-clamp, max=clamp)
    adv = (coef * diff * mask).detach()
    stats = {"distill/reverse_kl": float(masked_mean(-raw, mask).item()),
             "distill/teacher_logp": float(masked_mean(teacher_logp.float() * mask, mask).item()),
             "distill/student_logp": float(masked_mean(student_logp.float() * mask, mask).item()),
             "distill/adv_abs_mean": float(masked_mean(adv.abs(), mask).item())}
    return adv, stats


def mix_advantages(task_adv: torch.Tensor, distill_adv: torch.Tensor, loss_mask: torch.Tensor,
                   task_reward_weight: float) -> torch.Tensor:
    """``task_reward_weight * task_adv + distill_adv`` on loss positions; weight 0 is pure distillation (the
    task's advantage, however large, does not enter)."""
    mask = loss_mask.float()
    if task_reward_weight == 0:
        return distill_adv * mask
    return (task_reward_weight * task_adv.float() + distill_adv) * mask
