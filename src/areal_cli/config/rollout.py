"""``rollout`` group: asynchronous generation and its staleness bound."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from areal_cli.config.ranges import ranged

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

# The closed value sets of this group's string fields, written once: validation (plan/validate.py) and the
# field comments refer to them. Plain str fields, not Literal: OmegaConf 2.3's structured configs reject
# Literal annotations.
ROUTINGS = ("least_loaded", "round_robin")
WEIGHT_UPDATES = ("auto", "distributed", "disk")


@dataclass
class GenerationSettings:
    temperature: float = ranged(1.0, ge=1e-5, le=100.0,
                                why="greedy decoding is greedy=true, not temperature 0")
    top_p: float = ranged(1.0, gt=0.0, le=1.0, why="1.0 keeps the whole distribution")
    top_k: int = ranged(-1, ge=1, also=(-1,), why="-1 keeps every token")
    max_new_tokens: int = ranged(32, ge=1)
    min_new_tokens: int = ranged(0, ge=0)
    stop: list[str] = field(default_factory=list)
    greedy: bool = False


@dataclass
class RolloutConfig:
    # staleness bound in policy versions; 0 = synchronous (conf/rollout/: default 1, generation_bound 2)
    max_head_offpolicyness: int = ranged(1, ge=0, why="0 is synchronous RL")
    # Episodes generating at once, or auto: what the servers' KV cache holds with a margin, capped by the
    # staleness bound (and at 64 for the built-in hf server); allocation/autosize.py.
    max_concurrent_rollouts: int | str = ranged(64, ge=1, also=("auto",))
    group_size: int = ranged(8, ge=1)  # samples per prompt
    queue_size: int | None = ranged(None, ge=1, why="null sizes it at 4 x the batch")  # bounded result queue
    request_timeout_s: float = ranged(300.0, gt=0.0)
    request_retries: int = ranged(3, ge=0)
    routing: str = "least_loaded"  # one of ROUTINGS
    # one of WEIGHT_UPDATES. auto: a broadcast from the trainer (distributed), except through disk where a
    # vLLM server takes part (its weight transfer is its own NCCL rendezvous, docs/inference.md) or where
    # a LoRA adapter goes to a vLLM/SGLang server (they load adapters from a directory only).
    weight_update: str = "auto"
    weight_update_dtype: str = "float32"
    # Trainer rank 0 runs the executor, client and workflow in a worker process of their own (true)
    # or as a thread sharing the trainer's GIL (false); see rollout/worker.py.
    process: bool = True
    gconfig: GenerationSettings = field(default_factory=GenerationSettings)
    # Keep-Sampling-Mask (docs/training.md): the hf server records each token's top-k/top-p kept set
    # and the trainer renormalises its logprobs over it, so the importance ratio compares the policy
    # the tokens were drawn from. A no-op without truncation (top_p=1, top_k=-1) or with greedy.
    keep_sampling_mask: bool = False
    # Rollout routing replay, R3 (docs/training.md): the hf server returns the experts every MoE layer
    # routed each token to, and the trainer's forward uses the same experts (gate weights still its own).
    # MoE models, the fsdp engine and the hf server only (validated).
    routing_replay: bool = False
    eval_gconfig: GenerationSettings = field(default_factory=lambda: GenerationSettings(greedy=True))


def keep_sampling_mask_active(cfg: "ExperimentConfig") -> bool:
    """Whether the rollout records the mask: asked for, and the sampler truncates at all."""
    g = cfg.rollout.gconfig
    return bool(cfg.rollout.keep_sampling_mask) and not g.greedy and (g.top_p < 1.0 or g.top_k > 0)
