"""The rollout side's wiring: each function turns one config group into one live object (the tokenizer, the
inference client, the generation config, the reward, the workflow, the executor). The rollout worker, the
trainer's evaluation and ``areal eval`` build through these, so a workflow is wired one way everywhere."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from areal_cli.job.layout import SERVER_KEY_ENV

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


def build_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def build_client(cfg: ExperimentConfig, addresses: list[str], backend: str, tp_sizes: list[int] | int = 1, *,
                 adapter: bool = True) -> Any:
    """``tp_sizes``: each server's TP size (every TP rank joins the weight-update group). Under LoRA the
    client names the served adapter in every request; ``adapter=False``: the servers' base weights."""
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.weight_sync.lora import SERVED_NAME

    return RemoteInferenceEngine(addresses, backend=backend, timeout_s=cfg.rollout.request_timeout_s,
                                 retries=cfg.rollout.request_retries, routing=cfg.rollout.routing,
                                 tp_sizes=tp_sizes, api_key=os.environ.get(SERVER_KEY_ENV) or None,
                                 lora_name=SERVED_NAME if adapter and lora_enabled(cfg) else None)


def lora_enabled(cfg: ExperimentConfig) -> bool:
    """``model.lora.rank > 0``: the policy trains an adapter and the servers serve it by name."""
    lora = getattr(getattr(cfg, "model", None), "lora", None)
    return lora is not None and int(lora.rank) > 0


def build_gconfig(settings: Any, tokenizer: Any, **override: Any) -> Any:
    from areal_cli.api.io_struct import GenerationConfig

    g = GenerationConfig(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                         max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens,
                         stop=list(settings.stop), greedy=settings.greedy,
                         stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return g.new(**override) if override else g


def build_reward_fn(cfg: ExperimentConfig, addresses: list[str] | None = None) -> Any:
    """Rewards declared ``in_process`` (the cheap built-ins) run in-process; others (math-verify,
    code, user functions) in the time-bounded process pool, so a hanging or crashing reward cannot
    take the trainer down. A bad name fails here, before any worker is spawned.

    ``judge``: an LLM judge (rewards/judge.py) calling ``addresses`` (the run's inference servers,
    ``workflow.judge.server=rollout``) or ``workflow.judge.base_url``."""
    from areal_cli.rewards.registry import JUDGE, get_reward_fn, reward_runs_in_process
    from areal_cli.rewards.runner import AsyncRewardRunner

    w = cfg.workflow
    if w.reward == JUDGE:
        from areal_cli.rewards.judge import JudgeReward

        return JudgeReward(w.judge, addresses, api_key=os.environ.get(SERVER_KEY_ENV) or None)
    fn = get_reward_fn(w.reward)
    if reward_runs_in_process(w.reward):
        return fn
    return AsyncRewardRunner(w.reward, max_workers=w.reward_workers, timeout_s=w.reward_timeout_s)


def build_workflow(cfg: ExperimentConfig, tokenizer: Any, gconfig: Any | None = None,
                   reward_fn: Any | None = None, addresses: list[str] | None = None,
                   run_dir: str | None = None) -> Any:
    """The one place a workflow is wired from the config: ``workflow.name`` (built-in, plugin or
    import path) with the reward (:func:`build_reward_fn`), the generation config
    (:func:`build_gconfig`: stops on the tokenizer's EOS), ``workflow.*`` / ``rollout.group_size`` and the
    run's ``run_dir``; the caller owns closing a reward pool it did not pass in."""
    from areal_cli.rollout.workflows import build_workflow as _build, check_workflow_config

    w = cfg.workflow
    check_workflow_config(w.name, dict(w.kwargs))
    if gconfig is None:
        gconfig = build_gconfig(cfg.rollout.gconfig, tokenizer)
    return _build(w.name, reward_fn=reward_fn if reward_fn is not None else build_reward_fn(cfg, addresses),
                  gconfig=gconfig, tokenizer=tokenizer, group_size=cfg.rollout.group_size,
                  max_turns=w.max_turns, turn_discount=w.turn_discount, feedback=w.feedback, run_dir=run_dir,
                  **dict(w.kwargs))


def build_executor(cfg: ExperimentConfig, client: Any, workflow: Any, batch_size: int) -> Any:
    from areal_cli.rollout.executor import RolloutExecutor
    from areal_cli.rollout.filters import has_reward_variance

    return RolloutExecutor(client, workflow, batch_size=batch_size,
                           max_concurrent=cfg.rollout.max_concurrent_rollouts,
                           max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                           queue_size=cfg.rollout.queue_size,
                           # DAPO dynamic sampling: all-equal-reward groups are rejected (free capacity)
                           should_accept=has_reward_variance if cfg.algo.dynamic_sampling else None,
                           reject_patience=cfg.algo.dynamic_sampling_patience * batch_size
                           if cfg.algo.dynamic_sampling else 0)
