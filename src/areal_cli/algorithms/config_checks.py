"""The ``algo`` section's checks that need the algorithm registries: names (built-in or plugin), the
estimator's and the loss's declared needs, and the group size an estimator can learn from. Torch-free
(the registries hold specs and import paths), so ``areal validate-config`` runs them without torch."""

from __future__ import annotations

from areal_cli.config.algo import (BEHAV_IMP_WEIGHT_LEVELS, BEHAV_IMP_WEIGHT_MODES, NORM_LEVELS,
                                   PROX_LOGP_METHODS, AlgoConfig)
from areal_cli.config.ranges import check_ranges
from areal_cli.errors import ConfigError


def _one_of(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(path, f"unknown value {value!r}", f"use one of: {', '.join(allowed)}")


def validate_algo_config(cfg: AlgoConfig, prefix: str = "algo") -> None:
    """Raise :class:`ConfigError` for a bad ``algo`` section. Import-light (no torch)."""
    from areal_cli.algorithms.registry import POLICY_LOSSES, REGISTRIES

    check_ranges(cfg, prefix)  # every numeric knob against the range declared next to it
    p = prefix + "."
    for key, registry in REGISTRIES.items():  # names (built-in or plugin) come from the registries
        registry.entry(getattr(cfg, key), p + key)
    _one_of(p + "mean_level", cfg.mean_level, NORM_LEVELS)
    _one_of(p + "std_level", cfg.std_level, NORM_LEVELS)
    _one_of(p + "prox_logp_method", cfg.prox_logp_method, PROX_LOGP_METHODS)
    _one_of(p + "behav_imp_weight_mode", cfg.behav_imp_weight_mode, BEHAV_IMP_WEIGHT_MODES)
    _one_of(p + "behav_imp_weight_level", cfg.behav_imp_weight_level, BEHAV_IMP_WEIGHT_LEVELS)
    est = REGISTRIES["adv_estimator"].spec(cfg.adv_estimator)
    if est.needs_values and not cfg.use_critic:
        raise ConfigError(p + "use_critic", f"adv_estimator={cfg.adv_estimator} reads a value model's values "
                          "(it declares needs_values)", "set algo.use_critic=true (or algo=ppo), or pick a "
                          "critic-free estimator like grpo")
    if cfg.use_critic and not est.needs_values:
        raise ConfigError(p + "adv_estimator", f"use_critic=true but adv_estimator={cfg.adv_estimator!r} "
                          "ignores values", "set algo.adv_estimator=gae (or another estimator declaring "
                          "needs_values) or algo.use_critic=false")
    if cfg.distill.enabled and not POLICY_LOSSES.spec(cfg.policy_loss).uses_advantages:
        raise ConfigError(p + "distill.teacher_path", f"policy_loss={cfg.policy_loss} ignores advantages, so the "
                          "teacher's per-token advantage would train nothing", "use algo=grpo (or another "
                          "advantage-based loss), or set algo.distill.teacher_path=''")


def validate_group_size(cfg: AlgoConfig, group_size: int, path: str = "rollout.group_size") -> None:
    """Refuse ``group_size`` values an estimator cannot learn from (a cross-group rule).

    With one sample per prompt a group baseline is the sample itself, so the advantages are zero
    and only the KL and entropy terms would train; a group std is 0, so ``(r - mean) / (0 + eps)``
    blows the advantages up by 1/eps; and dynamic sampling drops every group, since one reward is
    trivially "all equal"."""
    from areal_cli.algorithms.registry import ADV_ESTIMATORS, POLICY_LOSSES

    if not POLICY_LOSSES.spec(cfg.policy_loss).uses_advantages or group_size >= 2:
        return
    est = ADV_ESTIMATORS.spec(cfg.adv_estimator)
    why = None
    if est.group_baseline or (est.uses_levels and cfg.mean_level == "group"):
        why = f"adv_estimator={cfg.adv_estimator} subtracts a group baseline, which for one sample is the " \
              "sample itself: every advantage would be 0"
    elif est.uses_levels and cfg.std_level == "group":
        why = "std_level=group divides by the std of one sample, which is 0"
    elif cfg.dynamic_sampling:
        why = "dynamic_sampling drops groups whose rewards are all equal, which is every group of one"
    if why is not None:
        raise ConfigError(path, f"{why} (group_size={group_size})",
                          f"set {path}=8 (samples per prompt), or pick an estimator without a group "
                          "baseline (algo=reinforce_pp, or algo.mean_level=batch algo.std_level=batch)")
