"""``algo`` group: the RL (or SFT) algorithm and its optimiser knobs.

Keys that select functions (``adv_estimator``, ``policy_loss``, ``loss_agg``, ``kl_estimator``)
are names in the registries of :mod:`areal_cli.algorithms.registry` (torch-free, so the CLI
validates before anything heavy loads): the allowed values and each entry's requirements (an
estimator that reads a critic's values, one with a group baseline) come from there. Presets in ``conf/algo/*.yaml`` set these the way each paper defines the algorithm;
docs/algorithms.md documents every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged

# The closed value sets of string fields, written once: algorithms/config_checks.py and the field comments
# refer to them. Plain str fields, not Literal: OmegaConf 2.3's structured configs reject Literal annotations.
NORM_LEVELS = ("group", "batch", "none")
PROX_LOGP_METHODS = ("recompute", "loglinear")
BEHAV_IMP_WEIGHT_MODES = ("truncate", "mask")
BEHAV_IMP_WEIGHT_LEVELS = ("token", "sequence")
# The one default of the per-token KL clamp (AlgoConfig, ActorLossParams, algorithms.kl). verl
# clamps its k3 ("low_var_kl") at ±10 against exp overflow; here the clamp applies to k1, k2 and k3.
KL_CLAMP = 10.0
# Algorithms that train without generating: no inference component, no rollouts, no weight pushes.
TRAIN_ONLY_ALGOS = ("sft", "rm")


def generates(name: str) -> bool:
    """Whether ``algo=<name>`` samples rollouts from inference servers (RL does; SFT and RM do not)."""
    return name not in TRAIN_ONLY_ALGOS


def samples_per_prompt(name: str, group_size: int) -> int:
    """Sequences one ``algo.batch_size`` unit trains on: a prompt's group, an SFT example, an RM pair's two sides."""
    return {"sft": 1, "rm": 2}.get(name, group_size)


@dataclass
class OptimConfig:
    lr: float = ranged(1e-5, gt=0.0, le=1.0)
    weight_decay: float = ranged(0.0, ge=0.0, le=1.0)
    beta1: float = ranged(0.9, ge=0.0, lt=1.0)
    beta2: float = ranged(0.999, ge=0.0, lt=1.0)
    eps: float = ranged(1e-8, gt=0.0, le=1.0)
    grad_clip: float = ranged(1.0, ge=0.0, why="0 disables gradient clipping")
    lr_scheduler: str = "constant"  # constant | linear | cosine
    warmup_steps: int = ranged(0, ge=0)
    min_lr_ratio: float = ranged(0.0, ge=0.0, le=1.0)


@dataclass
class DistillConfig:
    """On-policy distillation (docs/rewards.md, "Teachers"): a frozen teacher scores the student's sampled
    tokens and ``coef * (teacher_logp - student_logp)`` on each generated token is its advantage, alone or
    added to ``task_reward_weight`` times the task's advantage. Off while ``teacher_path`` is empty."""

    # a local HF dir (an `areal export`, save_pretrained) or a hub id; it must share the student's tokenizer
    teacher_path: str = ""
    # the teacher's training engine class (a forward-only copy in the trainer process); "" = engine.name
    engine: str = ""
    coef: float = ranged(1.0, gt=0.0, le=1e3)
    # 0 = pure distillation (the task's reward is logged, not trained on); 1 = task advantage + distillation
    task_reward_weight: float = ranged(0.0, ge=0.0, le=1e3, why="0 trains on the teacher alone")
    # |teacher_logp - student_logp| per token is clamped to this (a token the teacher finds impossible
    # would otherwise give an advantage of -inf-like size); 0 disables
    clamp: float = ranged(KL_CLAMP, ge=0.0, le=1e6, why="0 disables the clamp")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_path)


@dataclass
class AlgoConfig:
    name: str = "grpo"
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Prompts consumed per training step (each expands to rollout.group_size samples).
    batch_size: int = ranged(8, ge=1)
    ppo_n_minibatches: int = ranged(1, ge=1)  # optimiser steps per training step
    # --- advantages ---
    # grpo | drgrpo | rloo | reinforce_pp | reinforce_pp_baseline | gae | none | a registered plugin
    adv_estimator: str = "grpo"
    mean_level: str = "group"  # one of NORM_LEVELS
    std_level: str = "group"  # one of NORM_LEVELS
    std_unbiased: bool = True  # Bessel-corrected std (verl/TRL use torch.std, which is unbiased)
    adv_std_eps: float = ranged(1e-6, gt=0.0, le=1.0)  # (r - mean) / (std + eps)
    gamma: float = ranged(1.0, ge=0.0, le=1.0)
    lam: float = ranged(1.0, ge=0.0, le=1.0)
    adv_norm: bool = False  # whiten advantages over the batch's tokens after estimation
    reward_scaling: float = ranged(1.0, gt=0.0, le=1e6)
    reward_bias: float = ranged(0.0, ge=-1e6, le=1e6)
    reward_clip: float = ranged(20.0, gt=0.0, le=1e6)
    # --- policy loss ---
    policy_loss: str = "ppo"  # ppo | gspo | sft | a registered plugin
    eps_clip: float = ranged(0.2, gt=0.0, lt=1.0, why="PPO uses 0.2")
    # DAPO clip-higher; None → eps_clip
    eps_clip_high: float | None = ranged(None, gt=0.0, le=10.0,
                                         why="DAPO uses 0.28; null falls back to eps_clip")
    # dual clip; None disables
    c_clip: float | None = ranged(None, gt=1.0, le=1e3,
                                  why="dual clip needs c_clip > 1: 3.0 (Ye et al. 2020)")
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (token sum over
    # the constant rollout.gconfig.max_new_tokens, Dr.GRPO)
    loss_agg: str = "token-mean"
    # AReaL's decoupled PPO: the ratio against a proximal policy, stale samples reweighted by pi_prox/pi_behav
    # (capped at behav_imp_weight_cap). null: on exactly when samples can be stale (an RL algorithm with
    # rollout.max_head_offpolicyness > 0), as AReaL's async recipes run; validation resolves it (plan/validate.py)
    use_decoupled_loss: bool | None = None
    # how the decoupled loss gets its proximal policy (one of PROX_LOGP_METHODS): loglinear interpolates it from
    # the behaviour logprobs by each token's version, free; recompute runs a forward pass of the current weights
    # before the update (+24% train time per step on the 11.9M row, no better per step: benchmarks/results/vs_trl.md)
    prox_logp_method: str = "loglinear"
    # Recompute logp with the trainer before the update even without the decoupled loss; the PPO
    # ratio then uses the recomputed logp, and a set behav_imp_weight_cap corrects the
    # inference/trainer mismatch (truncated importance sampling).
    recompute_logprob: bool = False
    # behaviour IS correction cap (AReaL's async recipes: 5.0); None disables the cap. Applies under the
    # decoupled loss, or with recompute_logprob
    behav_imp_weight_cap: float | None = ranged(5.0, gt=0.0, le=1e6,
                                                why="AReaL uses 5.0; null disables the cap")
    behav_imp_weight_mode: str = "truncate"  # one of BEHAV_IMP_WEIGHT_MODES
    behav_imp_weight_level: str = "token"  # one of BEHAV_IMP_WEIGHT_LEVELS
    entropy_coef: float = ranged(0.0, ge=-1.0, le=1.0)
    temperature: float = ranged(1.0, ge=1e-5, le=100.0)  # must match rollout.gconfig.temperature (validated)
    # --- KL to a reference model ---
    kl_coef: float = ranged(0.0, ge=0.0, le=1e3, why="0 disables the KL term")
    kl_estimator: str = "k1"  # k1 | k2 | k3
    kl_in_reward: bool = False
    # clamp every per-token KL estimate (k1, k2, k3) to [-c, c]; 0 disables
    kl_clamp: float = ranged(KL_CLAMP, ge=0.0, le=1e6, why="0 disables the clamp")
    # --- DAPO ---
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    # stop the run once this many batches' worth of groups in a row were dropped (verl's max_num_gen_batches);
    # 0 keeps sampling for ever
    dynamic_sampling_patience: int = ranged(10, ge=0, why="0 never stops")
    # tokens; 0 → use overlong_buffer_ratio
    overlong_buffer_len: int = ranged(0, ge=0, why="0 disables the overlong penalty (with ratio 0)")
    # fraction of max_new_tokens; 0 with len 0 disables
    overlong_buffer_ratio: float = ranged(0.0, ge=0.0, lt=1.0, why="DAPO uses 0.2 (4096 of 20480 tokens)")
    overlong_penalty_factor: float = ranged(1.0, ge=0.0, le=1e3)
    # --- critic (PPO with GAE) ---
    use_critic: bool = False
    value_clip: float = ranged(0.2, gt=0.0, le=1e3, why="PPO uses 0.2")
    critic_lr: float = ranged(5e-6, gt=0.0, le=1.0)
    # --- on-policy distillation from a teacher model ---
    distill: DistillConfig = field(default_factory=DistillConfig)
