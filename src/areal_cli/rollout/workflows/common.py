"""Pieces shared by the built-in workflows: prompt building, reward calls, trajectory rows.

The data item a workflow receives is a dict (docs/rollout.md, "Data items"):

- the prompt, one of (first match wins):
  ``"prompt_ids"`` — token ids, used verbatim;
  ``"messages"`` — a chat (``[{"role": "user", "content": ...}, ...]``) rendered with the tokenizer's
  chat template and a generation prompt;
  ``"prompt"`` — a string, wrapped as one user message and rendered with the chat template
  (or tokenized verbatim when the workflow has ``use_chat_template=False``);
- ``"answer"`` — the reference handed verbatim to the reward function (may be absent → ``None``);
- anything else is carried along untouched (``"id"`` is copied into the trajectory's meta).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_cli.api.io_struct import GenerationConfig
from areal_cli.errors import ConfigError, DataError
from areal_cli.rewards.outcome import as_outcome, correct_code, correctness

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from areal_cli.api.workflow_api import Trajectory

RewardFn = Callable[[str, str, Any], "Awaitable[float] | float"]

_GROUP_IDS = itertools.count()


def next_group_id() -> int:
    """Process-unique id for one prompt's group of samples."""
    return next(_GROUP_IDS)


def check_group_and_reward(group_size: Any, reward_fn: Any) -> None:
    """Constructor checks every workflow shares: a positive group size and a callable reward."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError("rollout.group_size", f"must be a positive integer, got {group_size!r}",
                          "set rollout.group_size=8 (samples per prompt)")
    if not callable(reward_fn):
        raise ConfigError("workflow.reward", f"reward function {reward_fn!r} is not callable",
                          "use a built-in reward name or a dotted path to a function")


def load_tokenizer(tokenizer: Any) -> Any:
    """Accept a tokenizer object or a local path to one."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    if tokenizer is None:
        raise TypeError("a tokenizer (object or local path) is required")
    return tokenizer


def with_eos_stop(gconfig: GenerationConfig, tokenizer: Any) -> GenerationConfig:
    """Single-sample copy of ``gconfig`` that also stops on the tokenizer's eos token."""
    stops = list(gconfig.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stops:
        stops.append(int(eos))
    return gconfig.new(n=1, stop_token_ids=stops)


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):  # some templates return a list for batched input
        raise DataError("the tokenizer's chat template did not render to a string")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what the reward function sees as ``prompt``
    messages: list[dict[str, str]] | None  # the chat, when the prompt came as messages/prompt+template


def build_prompt(tokenizer: Any, data: dict[str, Any], use_chat_template: bool = True) -> Prompt:
    """Resolve a data item's prompt (see the module docstring for the keys)."""
    if "prompt_ids" in data and data["prompt_ids"] is not None:
        ids = [int(t) for t in data["prompt_ids"]]
        if not ids:
            raise DataError("data item has an empty 'prompt_ids'")
        messages = data.get("messages")
        text = _user_text(messages) if messages else (
            data["prompt"] if isinstance(data.get("prompt"), str) else decode(tokenizer, ids))
        return Prompt(ids, text, [dict(m) for m in messages] if messages else None)
    messages = data.get("messages")
    if messages is None and isinstance(data.get("prompt"), str):
        if not use_chat_template:
            return Prompt(encode(tokenizer, data["prompt"]), data["prompt"], None)
        messages = [{"role": "user", "content": data["prompt"]}]
    if not messages:
        raise DataError(f"data item has none of 'prompt_ids', 'messages', 'prompt' (keys: {sorted(data)}); "
                        "see docs/rollout.md, 'Data items'")
    messages = [dict(m) for m in messages]
    text = render_chat(tokenizer, messages, add_generation_prompt=True)
    return Prompt(encode(tokenizer, text), _user_text(messages) or text, messages)


def _user_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(content_text(m.get("content", "")) for m in messages if m.get("role") == "user")


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list content (image parts left out)."""
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content
                       if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
    return str(content)


def is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def call_reward(fn: RewardFn, prompt: str, completion: str, answer: Any) -> float:
    """Await an async reward callable; run a sync one in a worker thread so the loop keeps going.

    The result keeps the correctness the function stated (a :class:`~areal_cli.rewards.outcome.Reward`)."""
    if is_async_callable(fn):
        res = await fn(prompt, completion, answer)  # type: ignore[misc]
    else:
        res = await asyncio.to_thread(fn, prompt, completion, answer)
        if inspect.isawaitable(res):
            res = await res
    return as_outcome(res)


async def call_rewards(fn: RewardFn, prompt: str, completions: list[str], answer: Any) -> list[float]:
    """:func:`call_reward` for several completions of one prompt: concurrently for an async reward,
    in one worker-thread hop for a sync one (a hop per sample costs more than a cheap reward)."""
    if is_async_callable(fn):
        return list(await asyncio.gather(*(call_reward(fn, prompt, c, answer) for c in completions)))

    def run() -> list[Any]:
        return [fn(prompt, c, answer) for c in completions]

    out = []
    for res in await asyncio.to_thread(run):
        out.append(as_outcome(await res) if inspect.isawaitable(res) else as_outcome(res))
    return out


SAMPLING_CUTOFF = "sampling_cutoff"  # the batch key of engines/sampling_mask.py (not imported: no torch here)
ROUTED_EXPERTS = "routed_experts"  # the batch key of engines/routing_replay.py (-1: not recorded)


@dataclass
class Segment:
    """A run of tokens in a sequence; ``logprobs``/``versions`` only on generated segments."""

    ids: list[int]
    logprobs: list[float] | None = None
    versions: list[int] | None = None
    cutoffs: list[float] | None = None  # Keep-Sampling-Mask (ModelResponse.sampling_cutoffs)
    # Routing replay (ModelResponse.routed_experts): [positions 0..end-2 of the sequence so far, width]
    routing: Any = None

    @property
    def generated(self) -> bool:
        return self.logprobs is not None


def build_row(segments: list[Segment]) -> "dict[str, torch.Tensor]":
    """One sequence as 1-D tensors aligned with ``input_ids`` (entry i concerns token i).

    ``sampling_cutoff`` (Keep-Sampling-Mask) is added when a generated segment carries cutoffs:
    ``-inf`` (nothing cut) on prompt tokens and on segments without them.

    ``routed_experts`` (routing replay) is added when a generated segment carries routing: each covers
    the sequence from its start, and a position keeps the first segment's recording (a later turn
    re-reads earlier tokens); ``-1`` where nothing was recorded (the last token)."""
    import torch

    ids: list[int] = []
    lp: list[float] = []
    ver: list[int] = []
    mask: list[bool] = []
    cut: list[float] = []
    for s in segments:
        n = len(s.ids)
        ids.extend(int(t) for t in s.ids)
        if s.generated:
            assert s.logprobs is not None and s.versions is not None
            if len(s.logprobs) != n or len(s.versions) != n:
                raise ValueError(f"generated segment has {n} tokens but {len(s.logprobs)} logprobs and "
                                 f"{len(s.versions)} versions")
            lp.extend(float(x) for x in s.logprobs)
            if s.cutoffs is not None and len(s.cutoffs) != n:
                raise ValueError(f"generated segment has {n} tokens but {len(s.cutoffs)} sampling cutoffs")
            cut.extend([float("-inf")] * n if s.cutoffs is None else [float(x) for x in s.cutoffs])
            ver.extend(int(v) for v in s.versions)
            mask.extend([True] * n)
        else:
            lp.extend([0.0] * n)
            ver.extend([-1] * n)
            mask.extend([False] * n)
            cut.extend([float("-inf")] * n)
    row = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.ones(len(ids), dtype=torch.bool),
        "loss_mask": torch.tensor(mask, dtype=torch.bool),
        "logprobs": torch.tensor(lp, dtype=torch.float32),
        "versions": torch.tensor(ver, dtype=torch.long),
    }
    if any(s.cutoffs is not None for s in segments):
        row[SAMPLING_CUTOFF] = torch.tensor(cut, dtype=torch.float32)
    if any(s.routing is not None for s in segments):
        from areal_cli.engines.routing_replay import row_routing, stitch

        routing = None
        for s in segments:
            if s.routing is not None:
                routing = stitch(routing, s.routing)
        row[ROUTED_EXPERTS] = row_routing(routing, len(ids))
    return row


def stack_rows(rows: list["dict[str, torch.Tensor]"], rewards: list[float], no_eos: list[bool],
               group_id: int, pad_id: int, meta: dict[str, Any] | None = None,
               extra: "dict[str, torch.Tensor] | None" = None,
               correct: list[bool | None] | None = None) -> "Trajectory":
    """Right-pad rows into one group :class:`Trajectory` with per-sequence rewards and masks.

    ``correct`` [G] (int8: 1 correct, 0 wrong, -1 unknown) comes from ``correct`` when given, else
    from the correctness each reward carries (:mod:`areal_cli.rewards.outcome`)."""
    import torch

    from areal_cli.api.workflow_api import Trajectory

    from torch.nn.utils.rnn import pad_sequence

    fills = {"input_ids": pad_id, "versions": -1, SAMPLING_CUTOFF: float("-inf"), ROUTED_EXPERTS: -1}
    # One padded stack per key: this runs on the rollout thread, which shares the trainer's GIL.
    data: dict[str, torch.Tensor] = {key: pad_sequence([r[key] for r in rows], batch_first=True,
                                                       padding_value=fills.get(key, 0))
                                     for key in rows[0]}
    n = len(rows)
    data["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    data["seq_no_eos_mask"] = torch.tensor(no_eos, dtype=torch.bool)
    data["correct"] = torch.tensor([correct_code(c) for c in (rewards if correct is None else correct)],
                                   dtype=torch.int8)
    data["group_id"] = torch.full((n,), group_id, dtype=torch.long)
    if extra:
        data.update(extra)
    return Trajectory(data, dict(meta or {}))


def pad_token_id(tokenizer: Any) -> int:
    pid = getattr(tokenizer, "pad_token_id", None)
    if pid is None:
        pid = getattr(tokenizer, "eos_token_id", None)
    return int(pid) if pid is not None else 0


def eval_failed(workflow: Any, error: BaseException) -> dict[str, Any]:
    """An agent workflow's evaluation episode that raised: counted in ``workflow.failed``, logged, and
    scored as unsolved (``eval_episode``'s result), so one broken episode neither ends the run nor
    leaves its item out of ``eval/pass@1``'s denominator."""
    workflow.failed += 1
    logging.getLogger(__name__).warning("an evaluation episode failed (%s: %s); counted as unsolved",
                                        type(error).__name__, error)
    return {"success": False, "reward": 0.0, "tool_calls": 0}


def tool_call_count(client: Any) -> int:
    """The tool calls an episode's client (``ArealOpenAI``) recorded over all its calls."""
    return sum(len(it.output_message.get("tool_calls") or []) for it in client.cache)


def eval_result(client: Any, reward: Any, success_threshold: float) -> dict[str, Any]:
    """An agent workflow's greedy evaluation episode as ``eval_episode`` reports it: the reward (a number, a
    dict of per-call rewards summed, or None: the rewards set on the client, summed), success (the reward's
    correctness when it states one, else reward ≥ ``success_threshold``) and the tool calls."""
    if isinstance(reward, dict):
        reward = sum(float(v) for v in reward.values())
    elif reward is None:
        reward = sum(it.reward or 0.0 for it in client.cache)
    ok = correctness(reward)
    success = float(reward) >= success_threshold if ok is None else ok
    return {"success": success, "reward": float(reward), "tool_calls": tool_call_count(client)}
