"""Held-out evaluation through the inference servers (so it measures exactly what they serve).

- ``eval/pass@1``: one greedy completion per test item (``rollout.eval_gconfig``), correct when the
  reward function says so (``rewards.outcome``; every built-in reward does). ``eval/reward_mean`` is
  the greedy completions' mean reward.
- with ``trainer.eval_n_samples = n > 1``: ``n`` sampled completions per item at the rollout
  temperature; ``eval/pass@n`` is the fraction of items with at least one correct sample and
  ``eval/mean@n`` the mean per-sample accuracy (the unbiased pass@1 estimate under sampling).
- A reward function that returns plain numbers states no correctness: the pass/mean metrics count
  only completions whose correctness is known and are left out when there are none.

A workflow that defines ``eval_episode(engine, item) -> (success, reward)`` (the agent workflow) is
evaluated through it instead, so an agent is evaluated on what it is trained on: one greedy episode
per item, ``eval/pass@1`` = the success rate, ``eval/reward_mean`` = the mean reward,
``eval/tool_call_rate`` = the share of episodes that called a tool.

Runs on trainer rank 0 with its own client on its own event loop; it does not touch the rollout
executor's queues beyond pausing admissions, so the staleness accounting is unaffected.

A server that dies mid-evaluation fails the call with an ``InferenceError``. The caller then waits
for the launcher to restart it, brings it to the evaluated weights and calls again with the same
``done`` dict: completions already scored are kept, only the missing ones are generated
(``trainer/rl.py`` ``RLTrainer.evaluate``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


async def _eval_async(cfg: ExperimentConfig, addresses: list[str], backend: str, tokenizer: Any,
                      items: list[dict], reward_fn: Any, concurrency: int, done: dict, base: bool = False,
                      samples: dict | None = None, on_scored: Any = None) -> dict[str, float]:
    from areal_cli.api.io_struct import ModelRequest
    from areal_cli.rewards.outcome import correctness, is_dropped
    from areal_cli.models.vl_inputs import item_prompt_images
    from areal_cli.rollout.workflows.common import build_prompt, call_reward, decode, with_eos_stop
    from areal_cli.rollout import build

    client = build.build_client(cfg, addresses, backend, adapter=not base)
    greedy = with_eos_stop(build.build_gconfig(cfg.rollout.eval_gconfig, tokenizer, greedy=True), tokenizer)
    n = int(cfg.trainer.eval_n_samples)
    sampled = with_eos_stop(build.build_gconfig(cfg.rollout.gconfig, tokenizer, greedy=False), tokenizer)
    sem = asyncio.Semaphore(concurrency)

    async def one(key: tuple[int, int], item: dict, gconfig: Any) -> tuple[bool | None, int, float]:
        """``key`` = (item index, sample index; -1 for the greedy completion)."""
        if key in done:  # scored before a server restart interrupted an earlier attempt
            return done[key]
        prompt = build_prompt(tokenizer, item, cfg.dataset.use_chat_template)
        vis = item_prompt_images(tokenizer, item, prompt.ids)  # an item with images: as the rollout sends it
        async with sem:
            resp = await client.agenerate(ModelRequest(input_ids=list(prompt.ids) if vis is None else vis.ids,
                                                       gconfig=gconfig,
                                                       image_data=None if vis is None else vis.image_data,
                                                       image_pad_id=None if vis is None else vis.pad_id))
        completion = decode(tokenizer, resp.output_tokens)
        reward = await call_reward(reward_fn, prompt.text, completion, item.get("answer"))
        if is_dropped(reward):  # a judge that failed under on_failure=drop: nothing to drop here
            reward = 0.0
        done[key] = (correctness(reward), len(resp.output_tokens), float(reward))
        if samples is not None:
            samples[key] = {"item": key[0], "sample": key[1], "prompt": prompt.text, "completion": completion,
                            "answer": item.get("answer"), "reward": float(reward), "correct": done[key][0],
                            "n_tokens": len(resp.output_tokens)}
        if on_scored is not None:
            on_scored(key)
        return done[key]

    workflow = _episode_evaluator(cfg, tokenizer)

    async def through_workflow(key: tuple[int, int], item: dict) -> tuple[bool | None, int, float]:
        if key in done:
            return done[key]
        async with sem:
            res = await workflow.eval_episode(client, item)
        done[key] = (bool(res["success"]), int(res.get("tool_calls", 0)), float(res["reward"]))
        if samples is not None:
            samples[key] = {"item": key[0], "sample": key[1], "answer": item.get("answer"),
                            "reward": float(res["reward"]), "correct": bool(res["success"]),
                            "tool_calls": int(res.get("tool_calls", 0))}
        if on_scored is not None:
            on_scored(key)
        return done[key]

    try:
        if workflow is not None:
            res = await asyncio.gather(*[through_workflow((i, -1), it) for i, it in enumerate(items)])
            return {"eval/reward_mean": sum(r for _, _, r in res) / len(items),
                    "eval/pass@1": sum(bool(ok) for ok, _, _ in res) / len(items),
                    "eval/tool_call_rate": sum(n > 0 for _, n, _ in res) / len(items),
                    "eval/n_items": float(len(items))}
        greedy_res = await asyncio.gather(*[one((i, -1), it, greedy) for i, it in enumerate(items)])
        out = {"eval/reward_mean": sum(r for _, _, r in greedy_res) / len(items),
               "eval/mean_len": sum(ln for _, ln, _ in greedy_res) / len(items),
               "eval/n_items": float(len(items))}
        known = [ok for ok, _, _ in greedy_res if ok is not None]
        if known:
            out["eval/pass@1"] = sum(known) / len(known)
        if n > 1:
            per_item = await asyncio.gather(*[asyncio.gather(*[one((i, j), it, sampled) for j in range(n)])
                                              for i, it in enumerate(items)])
            per_item = [[ok for ok, _, _ in r if ok is not None] for r in per_item]
            judged = [r for r in per_item if r]
            if judged:
                out[f"eval/pass@{n}"] = sum(any(r) for r in judged) / len(judged)
                out[f"eval/mean@{n}"] = sum(sum(r) for r in judged) / sum(len(r) for r in judged)
    finally:
        if workflow is not None and hasattr(workflow, "close"):  # e.g. the proxy workflow's proxy
            workflow.close()
        close = getattr(client, "aclose", None) or getattr(client, "close", None)
        if close is not None:
            res = close()
            if asyncio.iscoroutine(res):
                await res
    return out


def _episode_evaluator(cfg: ExperimentConfig, tokenizer: Any) -> Any:
    """The run's workflow when it evaluates whole episodes itself (``eval_episode``), else None."""
    from areal_cli.rollout.workflows import resolve_workflow

    if not hasattr(resolve_workflow(cfg.workflow.name), "eval_episode"):
        return None
    from areal_cli.rollout import build

    gconfig = build.build_gconfig(cfg.rollout.eval_gconfig, tokenizer, greedy=True)
    return build.build_workflow(cfg, tokenizer, gconfig, reward_fn=lambda *a: 0.0)


def evaluate_on_servers(cfg: ExperimentConfig, addresses: list[str], backend: str, tokenizer: Any,
                        items: list[dict], *, executor: Any | None = None, reward_fn: Any | None = None,
                        concurrency: int = 64, done: dict | None = None, base: bool = False,
                        samples: dict | None = None, on_scored: Any = None) -> dict[str, float]:
    """Greedy pass@1 (and pass@n) of the servers' current weights on ``items``; ``base``: without the
    LoRA adapter (the model the servers started with, before any adapter is loaded). ``samples``: filled
    with each scored completion (``(item, sample)`` → prompt, completion, reward, correct; ``areal eval``'s
    per-sample file); ``on_scored(key)`` is called as each one is scored (a progress bar).

    ``done``: scored completions of an earlier, interrupted call on the same items and weights
    (filled in as completions are scored); they are not generated again."""
    from areal_cli.rollout import build

    if not items:
        return {}
    if reward_fn is None:
        reward_fn = build.build_reward_fn(cfg, addresses)
    t0 = time.perf_counter()
    if executor is not None:
        executor.pause()
    try:
        out = asyncio.run(_eval_async(cfg, addresses, backend, tokenizer, items, reward_fn, concurrency,
                                      {} if done is None else done, base, samples, on_scored))
    finally:
        if executor is not None:
            executor.resume()
    out["eval/time_s"] = time.perf_counter() - t0
    return out
