"""The algorithm layer's registries, keyed by the ``algo`` config values. Torch-free.

Each built-in is declared here once, by ``module:function`` target, with its requirements; the
functions themselves stay pure tensor functions in advantages.py, losses.py, kl.py and
normalisation.py. ``validate-config`` reads names and requirements from here without importing
torch. A plugin adds its own with the decorators (docs/architecture.md, "Registries and plugins")::

    from areal_cli.algorithms.registry import register_adv_estimator

    @register_adv_estimator("my_adv")
    def my_adv(*, rewards, loss_mask, group_size):
        ...  # return (advantages [B, L], returns [B, L] | None), zero off loss_mask

A function takes exactly the inputs it names, out of the registry's inputs (below); ``**kwargs``
is refused, so a misspelt input fails at registration instead of being swallowed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from areal_cli.registry import RegistrationError, Registry

_A = "areal_cli.algorithms.advantages:"
_L = "areal_cli.algorithms.losses:"
_N = "areal_cli.algorithms.normalisation:"
_K = "areal_cli.algorithms.kl:"


def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


# ---------------------------------------------------------------- advantage estimators

@dataclass(frozen=True)
class EstimatorSpec:
    # Reads a value model's ``values``: the run needs algo.use_critic=true (and a critic is only
    # trained for an estimator that reads it). The function must take ``values``.
    needs_values: bool = False
    # Always subtracts a statistic of the prompt's group: rollout.group_size must be >= 2.
    group_baseline: bool = False
    # Reads algo.mean_level / algo.std_level; at "group" level they need rollout.group_size >= 2.
    uses_levels: bool = False


# What the actor offers every estimator (algorithms/actor.py); each function names the ones it uses.
# rewards [B]; loss_mask [B, L]; group_size; token_rewards [B, L] | None (KL-in-reward, per-turn
# rewards); values [B, L] | None; gamma, lam; mean_level, std_level, std_unbiased, eps (the std's
# epsilon); reduce (sum over data-parallel ranks, or None); group_ids [B] | None.
ESTIMATOR_INPUTS = ("rewards", "loss_mask", "group_size", "token_rewards", "values", "gamma", "lam",
                    "mean_level", "std_level", "std_unbiased", "eps", "reduce", "group_ids")


def _check_estimator(name: str, fn: Any, spec: EstimatorSpec) -> None:
    if spec.needs_values != ("values" in _params(fn)):
        raise RegistrationError(f"adv_estimator {name!r}: declares needs_values={spec.needs_values} but "
                                f"{'does not take' if spec.needs_values else 'takes'} 'values'")


ADV_ESTIMATORS: Registry[EstimatorSpec] = Registry("adv_estimator", "algo.adv_estimator", EstimatorSpec,
                                                   inputs=ESTIMATOR_INPUTS, check=_check_estimator)
ADV_ESTIMATORS.declare("grpo", _A + "grpo_advantages", uses_levels=True)
ADV_ESTIMATORS.declare("drgrpo", _A + "drgrpo_advantages", group_baseline=True)
ADV_ESTIMATORS.declare("rloo", _A + "rloo_advantages", group_baseline=True)
ADV_ESTIMATORS.declare("reinforce_pp", _A + "reinforce_pp_advantages")
ADV_ESTIMATORS.declare("reinforce_pp_baseline", _A + "reinforce_pp_baseline_advantages", group_baseline=True)
ADV_ESTIMATORS.declare("gae", _A + "gae_advantages", needs_values=True)
ADV_ESTIMATORS.declare("none", _A + "no_baseline_advantages")
register_adv_estimator = ADV_ESTIMATORS.register


# ---------------------------------------------------------------- policy losses

@dataclass(frozen=True)
class PolicyLossSpec:
    # Optimises advantages (an RL objective). False (sft): no group is needed, and the KL-to-
    # reference term is not added to the loss.
    uses_advantages: bool = True


# logp, old_logp (the ratio's denominator: proximal or behaviour logp), advantages, loss_mask
# [B, L] (bool); eps_clip, eps_clip_high, c_clip from the algo group. Returns (per-token loss [B, L]
# zero off the mask, diagnostics); with "ratio"/"clip_mask"/"dual_clip_mask" the actor logs them.
POLICY_LOSS_INPUTS = ("logp", "old_logp", "advantages", "loss_mask", "eps_clip", "eps_clip_high", "c_clip")

POLICY_LOSSES: Registry[PolicyLossSpec] = Registry("policy_loss", "algo.policy_loss", PolicyLossSpec,
                                                   inputs=POLICY_LOSS_INPUTS)
POLICY_LOSSES.declare("ppo", _L + "ppo_policy_loss")
POLICY_LOSSES.declare("gspo", _L + "gspo_policy_loss")
POLICY_LOSSES.declare("sft", _L + "sft_policy_loss", uses_advantages=False)
register_policy_loss = POLICY_LOSSES.register


# ---------------------------------------------------------------- loss aggregation

@dataclass(frozen=True)
class LossAggSpec:
    # The unit the mean runs over: "token" or "sequence" (the engine weights micro-batches by it).
    unit: str = "sequence"
    # Divides by a constant (the generation budget, rollout.gconfig.max_new_tokens): takes ``norm``.
    needs_norm: bool = False

    def __post_init__(self) -> None:
        if self.unit not in ("token", "sequence"):
            raise TypeError(f"unit must be 'token' or 'sequence', not {self.unit!r}")


def _check_agg(name: str, fn: Any, spec: LossAggSpec) -> None:
    if spec.needs_norm != ("norm" in _params(fn)):
        raise RegistrationError(f"loss_agg {name!r}: declares needs_norm={spec.needs_norm} but "
                                f"{'does not take' if spec.needs_norm else 'takes'} 'norm'")


LOSS_AGG: Registry[LossAggSpec] = Registry("loss_agg", "algo.loss_agg", LossAggSpec,
                                           inputs=("loss", "mask", "norm"), check=_check_agg)
LOSS_AGG.declare("token-mean", _N + "token_mean", unit="token")
LOSS_AGG.declare("seq-mean-token-sum", _N + "seq_mean_token_sum")
LOSS_AGG.declare("seq-mean-token-mean", _N + "seq_mean_token_mean")
LOSS_AGG.declare("seq-mean-token-sum-norm", _N + "seq_mean_token_sum_norm", needs_norm=True)
register_loss_agg = LOSS_AGG.register


# ---------------------------------------------------------------- KL estimators

KL_ESTIMATORS: Registry = Registry("kl_estimator", "algo.kl_estimator", inputs=("logp", "ref_logp"))
KL_ESTIMATORS.declare("k1", _K + "kl_k1")
KL_ESTIMATORS.declare("k2", _K + "kl_k2")
KL_ESTIMATORS.declare("k3", _K + "kl_k3")
register_kl_estimator = KL_ESTIMATORS.register

REGISTRIES: dict[str, Registry] = {
    "adv_estimator": ADV_ESTIMATORS,
    "policy_loss": POLICY_LOSSES,
    "loss_agg": LOSS_AGG,
    "kl_estimator": KL_ESTIMATORS,
}
