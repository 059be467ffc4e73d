"""``algo`` group: the RL (or SFT) algorithm and its optimiser knobs.

Keys that select functions (``adv_estimator``, ``policy_loss``, ``loss_agg``, ``kl_estimator``)
are registry keys in :mod:`areal_cli.algorithms`. Presets in ``conf/algo/*.yaml`` set these the
way each paper defines the algorithm; docs/algorithms.md documents every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    gamma: float = 1.0
    lam: float = 1.0
    adv_norm: bool = False  # whiten advantages over the batch after estimation
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    # --- policy loss ---
    policy_loss: str = "ppo"  # ppo | gspo | sft
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # DAPO clip-higher; None → eps_clip
    c_clip: float | None = None  # dual clip; None disables
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    use_decoupled_loss: bool = False  # AReaL decoupled PPO (proximal policy)
    prox_logp_method: str = "recompute"  # recompute | loglinear
    behav_imp_weight_cap: float | None = None  # behaviour IS correction cap; None disables
    behav_imp_weight_mode: str = "truncate"  # truncate | mask
    behav_imp_weight_level: str = "token"  # token | sequence
    entropy_coef: float = 0.0
    temperature: float = 1.0  # must match rollout.gconfig.temperature (validated)
    # --- KL to a reference model ---
    kl_coef: float = 0.0
    kl_estimator: str = "k1"  # k1 | k2 | k3
    kl_in_reward: bool = False
    # --- DAPO ---
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    overlong_buffer_len: int = 0  # 0 disables the overlong penalty
    overlong_penalty_factor: float = 1.0
    # --- critic (PPO with GAE) ---
    use_critic: bool = False
    value_clip: float = 0.2
    critic_lr: float = 5e-6
