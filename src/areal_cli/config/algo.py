"""``algo`` group: the RL (or SFT) algorithm and its optimiser knobs.

Keys that select functions (``adv_estimator``, ``policy_loss``, ``loss_agg``, ``kl_estimator``)
are registry keys in :mod:`areal_cli.algorithms`. The tuples below list them without importing
torch (the CLI validates configs before anything heavy loads); a unit test keeps them equal to the
registries. Presets in ``conf/algo/*.yaml`` set these the way each paper defines the algorithm;
docs/algorithms.md documents every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.errors import ConfigError

ADV_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none")
NORM_LEVELS = ("group", "batch", "none")
POLICY_LOSSES = ("ppo", "gspo", "sft")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
PROX_LOGP_METHODS = ("recompute", "loglinear")
BEHAV_IMP_WEIGHT_MODES = ("truncate", "mask")
BEHAV_IMP_WEIGHT_LEVELS = ("token", "sequence")
# The one default of the per-token KL clamp (AlgoConfig, ActorLossParams, algorithms.kl). verl
# clamps its k3 ("low_var_kl") at ±10 against exp overflow; here the clamp applies to k1, k2 and k3.
KL_CLAMP = 10.0


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    lr_scheduler: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class AlgoConfig:
    name: str = "grpo"
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Prompts consumed per training step (each expands to rollout.group_size samples).
    batch_size: int = 8
    ppo_n_minibatches: int = 1  # optimiser steps per training step
    # --- advantages ---
    adv_estimator: str = "grpo"  # grpo | drgrpo | rloo | reinforce_pp | reinforce_pp_baseline | gae | none
    mean_level: str = "group"  # group | batch | none
    std_level: str = "group"  # group | batch | none
    std_unbiased: bool = True  # Bessel-corrected std (verl/TRL use torch.std, which is unbiased)
    adv_std_eps: float = 1e-6  # (r - mean) / (std + eps)
    gamma: float = 1.0
    lam: float = 1.0
    adv_norm: bool = False  # whiten advantages over the batch's tokens after estimation
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    # --- policy loss ---
    policy_loss: str = "ppo"  # ppo | gspo | sft
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # DAPO clip-higher; None → eps_clip
    c_clip: float | None = None  # dual clip; None disables
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (token sum over
    # the constant rollout.gconfig.max_new_tokens, Dr.GRPO)
    loss_agg: str = "token-mean"
    use_decoupled_loss: bool = False  # AReaL decoupled PPO (proximal policy)
    prox_logp_method: str = "recompute"  # recompute | loglinear
    # Recompute logp with the trainer before the update even without the decoupled loss; the PPO
    # ratio then uses the recomputed logp, and a set behav_imp_weight_cap corrects the
    # inference/trainer mismatch (truncated importance sampling).
    recompute_logprob: bool = False
    behav_imp_weight_cap: float | None = None  # behaviour IS correction cap; None disables the cap
    behav_imp_weight_mode: str = "truncate"  # truncate | mask
    behav_imp_weight_level: str = "token"  # token | sequence
    entropy_coef: float = 0.0
    temperature: float = 1.0  # must match rollout.gconfig.temperature (validated)
    # --- KL to a reference model ---
    kl_coef: float = 0.0
    kl_estimator: str = "k1"  # k1 | k2 | k3
    kl_in_reward: bool = False
    kl_clamp: float = KL_CLAMP  # clamp every per-token KL estimate (k1, k2, k3) to [-c, c]; 0 disables
    # --- DAPO ---
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    overlong_buffer_len: int = 0  # tokens; 0 → use overlong_buffer_ratio
    overlong_buffer_ratio: float = 0.0  # fraction of max_new_tokens; 0 with len 0 disables
    overlong_penalty_factor: float = 1.0
    # --- critic (PPO with GAE) ---
    use_critic: bool = False
    value_clip: float = 0.2
    critic_lr: float = 5e-6


def _one_of(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(path, f"unknown value {value!r}", f"use one of: {', '.join(allowed)}")


def validate_algo_config(cfg: AlgoConfig, prefix: str = "algo") -> None:
    """Raise :class:`ConfigError` for a bad ``algo`` section. Import-light (no torch)."""
    p = prefix + "."
    _one_of(p + "adv_estimator", cfg.adv_estimator, ADV_ESTIMATORS)
    _one_of(p + "mean_level", cfg.mean_level, NORM_LEVELS)
    _one_of(p + "std_level", cfg.std_level, NORM_LEVELS)
    _one_of(p + "policy_loss", cfg.policy_loss, POLICY_LOSSES)
    _one_of(p + "loss_agg", cfg.loss_agg, LOSS_AGGS)
    _one_of(p + "kl_estimator", cfg.kl_estimator, KL_ESTIMATORS)
    _one_of(p + "prox_logp_method", cfg.prox_logp_method, PROX_LOGP_METHODS)
    _one_of(p + "behav_imp_weight_mode", cfg.behav_imp_weight_mode, BEHAV_IMP_WEIGHT_MODES)
    _one_of(p + "behav_imp_weight_level", cfg.behav_imp_weight_level, BEHAV_IMP_WEIGHT_LEVELS)
    if cfg.batch_size < 1:
        raise ConfigError(p + "batch_size", f"must be >= 1, got {cfg.batch_size}", "set algo.batch_size=8")
    if cfg.ppo_n_minibatches < 1:
        raise ConfigError(p + "ppo_n_minibatches", f"must be >= 1, got {cfg.ppo_n_minibatches}",
                          "set algo.ppo_n_minibatches=1")
    if not 0.0 < cfg.eps_clip < 1.0:
        raise ConfigError(p + "eps_clip", f"must be in (0, 1), got {cfg.eps_clip}", "PPO uses 0.2")
    if cfg.eps_clip_high is not None and cfg.eps_clip_high <= 0:
        raise ConfigError(p + "eps_clip_high", f"must be > 0, got {cfg.eps_clip_high}",
                          "DAPO uses 0.28; null falls back to eps_clip")
    if cfg.c_clip is not None and cfg.c_clip <= 1.0:
        raise ConfigError(p + "c_clip", f"dual clip needs c_clip > 1, got {cfg.c_clip}",
                          "use 3.0 (Ye et al. 2020) or null to disable")
    if cfg.behav_imp_weight_cap is not None and cfg.behav_imp_weight_cap <= 0:
        raise ConfigError(p + "behav_imp_weight_cap", f"must be > 0, got {cfg.behav_imp_weight_cap}",
                          "AReaL uses 5.0; null disables the cap")
    for name in ("gamma", "lam"):
        v = getattr(cfg, name)
        if not 0.0 <= v <= 1.0:
            raise ConfigError(p + name, f"must be in [0, 1], got {v}", f"set algo.{name}=1.0")
    if cfg.kl_coef < 0:
        raise ConfigError(p + "kl_coef", f"must be >= 0, got {cfg.kl_coef}", "0 disables the KL term")
    if cfg.adv_std_eps <= 0:
        raise ConfigError(p + "adv_std_eps", f"must be > 0, got {cfg.adv_std_eps}", "use 1e-6")
    if cfg.reward_clip <= 0:
        raise ConfigError(p + "reward_clip", f"must be > 0, got {cfg.reward_clip}", "use 20.0")
    if cfg.overlong_buffer_len < 0:
        raise ConfigError(p + "overlong_buffer_len", f"must be >= 0, got {cfg.overlong_buffer_len}",
                          "0 disables the overlong penalty")
    if not 0.0 <= cfg.overlong_buffer_ratio < 1.0:
        raise ConfigError(p + "overlong_buffer_ratio", f"must be in [0, 1), got {cfg.overlong_buffer_ratio}",
                          "DAPO uses 0.2 (4096 of 20480 tokens)")
    if cfg.adv_estimator == "gae" and not cfg.use_critic:
        raise ConfigError(p + "use_critic", "adv_estimator=gae needs a value model",
                          "set algo.use_critic=true (or algo=ppo), or pick a critic-free estimator like grpo")
    if cfg.use_critic and cfg.adv_estimator != "gae":
        raise ConfigError(p + "adv_estimator", f"use_critic=true but adv_estimator={cfg.adv_estimator!r} "
                          "ignores values", "set algo.adv_estimator=gae or algo.use_critic=false")
    if cfg.value_clip <= 0:
        raise ConfigError(p + "value_clip", f"must be > 0, got {cfg.value_clip}", "PPO uses 0.2")
    if cfg.prox_logp_method == "loglinear" and not cfg.use_decoupled_loss:
        raise ConfigError(p + "prox_logp_method", "loglinear approximates the proximal policy of the "
                          "decoupled loss, which is off", "set algo.use_decoupled_loss=true")
    if cfg.temperature <= 0:
        raise ConfigError(p + "temperature", f"must be > 0, got {cfg.temperature}",
                          "match rollout.gconfig.temperature (1.0)")


def validate_group_size(cfg: AlgoConfig, group_size: int, path: str = "rollout.group_size") -> None:
    """Refuse ``group_size`` values an estimator cannot learn from (a cross-group rule).

    With one sample per prompt a group baseline is the sample itself, so the advantages are zero
    and only the KL and entropy terms would train; a group std is 0, so ``(r - mean) / (0 + eps)``
    blows the advantages up by 1/eps; and dynamic sampling drops every group, since one reward is
    trivially "all equal"."""
    if cfg.policy_loss == "sft" or group_size >= 2:
        return
    why = None
    if cfg.adv_estimator in ("drgrpo", "rloo", "reinforce_pp_baseline") or \
            (cfg.adv_estimator == "grpo" and cfg.mean_level == "group"):
        why = f"adv_estimator={cfg.adv_estimator} subtracts a group baseline, which for one sample is the " \
              "sample itself: every advantage would be 0"
    elif cfg.adv_estimator == "grpo" and cfg.std_level == "group":
        why = "std_level=group divides by the std of one sample, which is 0"
    elif cfg.dynamic_sampling:
        why = "dynamic_sampling drops groups whose rewards are all equal, which is every group of one"
    if why is not None:
        raise ConfigError(path, f"{why} (group_size={group_size})",
                          f"set {path}=8 (samples per prompt), or pick an estimator without a group "
                          "baseline (algo=reinforce_pp, or algo.mean_level=batch algo.std_level=batch)")
