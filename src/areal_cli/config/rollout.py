"""``rollout`` group: asynchronous generation and its staleness bound."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    greedy: bool = False


@dataclass
class RolloutConfig:
    max_head_offpolicyness: int = 2  # staleness bound in policy versions; 0 = synchronous
    max_concurrent_rollouts: int = 64
    group_size: int = 8  # samples per prompt
    queue_size: int | None = None  # bounded result queue; None → 4 × batch
    request_timeout_s: float = 300.0
    request_retries: int = 3
    routing: str = "least_loaded"  # least_loaded | round_robin
    weight_update: str = "distributed"  # distributed | disk
    weight_update_dtype: str = "float32"
    # Trainer rank 0 runs the executor, client and workflow in a worker process of their own (true)
    # or as a thread sharing the trainer's GIL (false); see trainer/rollout_worker.py.
    process: bool = True
    gconfig: GenerationSettings = field(default_factory=GenerationSettings)
    eval_gconfig: GenerationSettings = field(default_factory=lambda: GenerationSettings(greedy=True))
