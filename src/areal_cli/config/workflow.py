"""``workflow`` group: how one dataset item becomes a scored trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged
from typing import Any

# The closed value sets of workflow.reward_model's string fields (plan/validate.py CHOICES checks them).
# rm_only: the reward model's score alone; sum: rule_weight * rule + weight * score; gate: the sum where the
# rule reward is positive, the rule reward alone elsewhere (the reward model ranks only what the rule passes).
RM_COMBINES = ("rm_only", "sum", "gate")
# none: the raw scores; batch: (score - mean) / std over the step's batch (every data-parallel rank's rows)
RM_NORMALIZES = ("none", "batch")


@dataclass
class JudgeConfig:
    """``workflow.judge``: an LLM judge scoring each completion (``workflow.reward=judge``, docs/rewards.md)."""

    # rollout: the run's own inference servers (the policy judges itself); url: an OpenAI-compatible
    # server at base_url (another model). A separately launched judge component is not built yet.
    server: str = "rollout"
    base_url: str | None = None  # http://host:port of an OpenAI-compatible server (server=url)
    api_key_env: str | None = None  # the environment variable holding base_url's API key
    model: str | None = None  # the "model" field of each request (null: the server's own model)
    # Empty: the built-in prompt for `parse`; text with {question} {response} {reference}; or a file path.
    template: str = ""
    parse: str = "verdict"  # verdict (a word from `verdicts`) | score (a number in [0, 1]) | score10 ([0, 10])
    verdicts: dict[str, float] = field(default_factory=lambda: {"correct": 1.0, "incorrect": 0.0})
    regex: str = ""  # optional: its group 1 (or the whole match) is the verdict word or the number
    pass_threshold: float = ranged(0.5, ge=0.0, le=1.0)  # a score at or above it counts as correct
    max_concurrent: int = ranged(8, ge=1)
    timeout_s: float = ranged(30.0, gt=0.0)
    max_new_tokens: int = ranged(16, ge=1)
    temperature: float = ranged(0.0, ge=0.0)
    on_failure: str = "zero"  # zero | drop (the episode's group) | retry (then `after_retries`)
    max_retries: int = ranged(2, ge=1)
    after_retries: str = "zero"  # zero | drop
    # The run stops with an error after this many judge calls in a row failed because the judge is down
    # (timeout, unreachable, error; under drop, any failure) — 0: never. A dead judge would otherwise
    # train on zeros, or under drop wait for ever for a full batch. Garbage answers alone never stop it.
    max_failures_in_row: int = ranged(64, ge=0)
    rule: str = ""  # optional cheap rule reward (numeric, exact) combined with the judge's score
    combine: str = "gate"  # gate: rule 0 -> 0 without a judge call | add: rule + weight * judge
    weight: float = ranged(1.0, ge=0.0)
    log_samples: int = ranged(4, ge=0)  # judge verdicts per step written to the run's judge.jsonl


@dataclass
class RewardModelConfig:
    """``workflow.reward_model``: a trained reward model (an ``algo=rm`` export) scores every sampled completion
    in the trainer, before the advantages (docs/rewards.md, "Scoring RL samples with a reward model"). Off
    while ``path`` is empty; the held-out evaluation stays the task's rule reward."""

    # a local dir holding an algo=rm export (value_head.safetensors) or a hub id; the policy's tokenizer
    path: str = ""
    combine: str = "sum"  # one of RM_COMBINES
    weight: float = ranged(1.0, gt=0.0, le=1e3)  # the reward model's score's weight
    # the rule reward's (workflow.reward) weight under sum and gate; rm_only refuses another value
    rule_weight: float = ranged(1.0, ge=0.0, le=1e3)
    normalize: str = "none"  # one of RM_NORMALIZES

    @property
    def enabled(self) -> bool:
        return bool(self.path)


@dataclass
class WorkflowConfig:
    # rlvr | multi_turn | a dotted import path to a RolloutWorkflow subclass
    name: str = "rlvr"
    reward: str = "numeric"  # numeric | exact | math | code | judge | import path to a reward function
    reward_timeout_s: float = ranged(15.0, gt=0.0)
    reward_workers: int = ranged(2, ge=1)
    max_turns: int = ranged(2, ge=1)  # multi_turn
    turn_discount: float = ranged(0.9, gt=0.0, le=1.0)  # multi_turn
    feedback: str = "Your answer is wrong. Try again."  # multi_turn retry prompt
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra kwargs for a user workflow
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
