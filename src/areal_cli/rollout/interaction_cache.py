"""The interaction cache: every OpenAI call an agent makes in one episode, as training data.

Each call (:class:`Interaction`) records the prompt ids actually sent, the output ids, their logprobs
and per-token policy versions, the stop reason, the messages and tools it was called with and the
assistant message it returned.

Links between calls:
- ``parent_id`` (message parent): the longest earlier, finished call whose messages plus its
  assistant message are an exact prefix of this call's messages (message content ``None`` and ``""``
  compare equal; tool-call arguments compare as JSON). Rewards are discounted along these links.
- ``token_parent_id``: set when this call's prompt ids *start with* the parent's real prompt + output
  ids (the client builds prompts that way, see ``rollout/openai_client.py``). Only such chains can
  be exported as one row with several trained segments.

Rewards (:meth:`InteractionCache.apply_discount`, once): walking calls newest to oldest,
``R_i = r_i + gamma * mean(R_c for c in children(i))`` (``r_i`` = the reward set on call ``i``, 0
when unset; a call without children keeps ``R_i = r_i``). For a chain of calls this is
``R_i = sum_{j >= i} gamma^(j-i) r_j``: gamma=0.9 and a final reward of 2 over 3 turns gives
1.62, 1.8, 2.0. Branches (two calls continuing the same conversation) share their parent through
the mean, and never leak reward into each other.

Export (:meth:`InteractionCache.export`):
- ``"per_call"``: one row per finished call: its prompt (mask 0) + its output (mask 1); the row's
  reward is the discounted ``R_i`` when :meth:`apply_discount` ran, else ``r_i``.
- ``"per_leaf"``: one row per token chain leaf: the root's prompt, then each call's output (mask 1)
  and the template tokens between calls (tool results, the next turn's header: mask 0). The row's
  ``reward`` is the leaf's own ``r``; every earlier call's ``r`` sits in ``token_rewards`` on its
  last generated token, so token-level estimators see each turn's reward where it was earned and
  outcome estimators score the row by the sum.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Interaction:
    id: str
    messages: list[dict]  # as the template saw them (normalised, deep-copied)
    tools: list[dict] | None
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str  # the engine's: stop | length
    output_message: dict  # the assistant message returned (OpenAI shape)
    parent_id: str | None = None
    token_parent_id: str | None = None
    retokenized: bool = False  # the prompt ids differ from a fresh render of the messages
    render_diff_at: int | None = None  # the first prompt position where a fresh render differs
    rewritten_history: bool = False  # the template renders earlier turns otherwise than they were sampled
    reward: float | None = None
    discounted: float | None = None
    response: Any = None  # the SDK object returned to the agent
    images: list[str] = field(default_factory=list)  # the prompt's images (data URLs), in prompt order
    created: float = field(default_factory=time.time)


def _canon_message(m: dict) -> tuple:
    calls = tuple((c.get("id"), c["function"]["name"], _canon_args(c["function"].get("arguments")))
                  for c in (m.get("tool_calls") or []))
    return m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"), m.get("name")


def _canon_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True)


def _check_reward(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"a reward must be a finite number, got {reward!r}")
    return float(reward)


class InteractionCache:
    """The calls of one episode, in insertion order (see the module docstring)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Interaction] = OrderedDict()
        self._discount: float | None = None

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items.values())

    def __getitem__(self, interaction_id: str) -> Interaction:
        return self._items[interaction_id]

    @property
    def last(self) -> Interaction | None:
        return next(reversed(self._items.values())) if self._items else None

    def find_parent(self, messages: list[dict], tools: list[dict] | None = None) -> Interaction | None:
        """The longest earlier call whose messages + assistant message prefix ``messages``."""
        want = [_canon_message(m) for m in messages]
        best = None
        for it in self._items.values():
            have = [_canon_message(m) for m in it.messages + [it.output_message]]
            longer = best is None or len(have) > len(best.messages) + 1
            if len(have) < len(want) and want[:len(have)] == have and longer:
                best = it
        return best

    def add(self, it: Interaction) -> None:
        if it.id in self._items:
            raise ValueError(f"interaction {it.id} is already in the cache")
        if self._discount is not None:
            raise RuntimeError("the reward discount was already applied; no new calls can join this episode")
        it.messages = copy.deepcopy(it.messages)
        self._items[it.id] = it

    def set_reward(self, interaction_id: str, reward: float) -> None:
        if interaction_id not in self._items:
            raise KeyError(f"no interaction {interaction_id!r} in this episode "
                           f"(known: {list(self._items)[:5]}{'...' if len(self._items) > 5 else ''})")
        self._items[interaction_id].reward = _check_reward(reward)

    def set_last_reward(self, reward: float) -> None:
        if not self._items:
            raise RuntimeError("set_last_reward: the episode made no calls yet")
        self.last.reward = _check_reward(reward)  # type: ignore[union-attr]

    def children(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {k: [] for k in self._items}
        for it in self._items.values():
            if it.parent_id in out:
                out[it.parent_id].append(it.id)
        return out

    def apply_discount(self, gamma: float) -> dict[str, float]:
        """Discounted returns along message links (module docstring); allowed once."""
        if self._discount is not None:
            raise RuntimeError(f"the reward discount was already applied (gamma={self._discount}); applying "
                               "it twice would discount earlier turns again")
        if not 0.0 <= float(gamma) <= 1.0:
            raise ValueError(f"turn discount gamma must be in [0, 1], got {gamma!r}")
        kids = self.children()
        for it in reversed(self._items.values()):
            r = it.reward or 0.0
            ch = [self._items[c].discounted for c in kids[it.id]]
            it.discounted = r + (float(gamma) * sum(ch) / len(ch) if ch else 0.0)  # type: ignore[arg-type]
        self._discount = float(gamma)
        return {k: it.discounted for k, it in self._items.items()}  # type: ignore[misc]

    @property
    def discount_applied(self) -> bool:
        return self._discount is not None

    # ------------------------------------------------------------------ export
    def export(self, style: str = "per_call") -> list[dict[str, Any]]:
        """Rows as plain lists: ``segments`` (``(ids, logprobs|None, versions|None)``), ``reward``,
        ``turn_rewards`` (per generated segment), ``ids`` (the calls in the row), ``no_eos``."""
        if style == "per_call":
            return [self._row([it], self._reward_of(it)) for it in self._items.values()]
        if style == "per_leaf":
            token_children = {it.token_parent_id for it in self._items.values() if it.token_parent_id}
            rows = []
            for leaf in self._items.values():
                if leaf.id in token_children:
                    continue
                chain = [leaf]
                while chain[0].token_parent_id is not None:
                    chain.insert(0, self._items[chain[0].token_parent_id])
                rows.append(self._row(chain, leaf.reward or 0.0))
            return rows
        raise ValueError(f"unknown export style {style!r}; use 'per_call' or 'per_leaf'")

    def _reward_of(self, it: Interaction) -> float:
        return it.discounted if it.discounted is not None else (it.reward or 0.0)

    @staticmethod
    def _row(chain: list[Interaction], reward: float) -> dict[str, Any]:
        segs: list[tuple[list[int], list[float] | None, list[int] | None]] = []
        have: list[int] = []
        for it in chain:
            if have and it.input_ids[:len(have)] != have:
                raise RuntimeError(f"internal: {it.id}'s prompt does not extend its token parent's ids")
            gap = it.input_ids[len(have):]
            if gap:
                segs.append((list(gap), None, None))
            segs.append((list(it.output_ids), list(it.logprobs), list(it.versions)))
            have = list(it.input_ids) + list(it.output_ids)
        row = {"segments": segs, "reward": float(reward), "ids": [it.id for it in chain],
               "turn_rewards": [it.reward or 0.0 for it in chain[:-1]] + [0.0],
               "no_eos": chain[-1].stop_reason == "length"}
        if chain[-1].images:  # the last call's prompt holds every image of the row (plain strings: JSON-safe)
            row["images"] = list(chain[-1].images)
        return row


def rows_to_tensors(rows: list[dict[str, Any]], pad_id: int, group_id: int, tokenizer: Any = None) -> Any:
    """Exported rows -> one :class:`~areal_cli.api.workflow_api.Trajectory` (``group_id`` on every
    row; ``token_rewards`` [B, L] when any row carries per-turn rewards; ``multi_modal`` when any row
    carries ``images``: their features from ``tokenizer``'s model dir's image processor)."""
    import torch

    from areal_cli.rollout.workflows.common import Segment, build_row, stack_rows

    built = []
    for r in rows:
        segs = [Segment(ids, lp, ver) for ids, lp, ver in r["segments"]]
        row = build_row(segs)
        tr = torch.zeros(row["input_ids"].shape[0], dtype=torch.float32)
        pos, k = 0, 0
        for s in segs:
            pos += len(s.ids)
            if s.generated:
                if s.ids:
                    tr[pos - 1] += r["turn_rewards"][k]
                k += 1
        row["token_rewards"] = tr
        built.append(row)
    if not any(any(r["turn_rewards"]) for r in rows):
        for row in built:
            del row["token_rewards"]
    correct = [r.get("correct") for r in rows] if any("correct" in r for r in rows) else None
    traj = stack_rows(built, [r["reward"] for r in rows], [r["no_eos"] for r in rows], group_id, pad_id,
                      {"interaction_ids": [r["ids"] for r in rows]}, correct=correct)
    if any(r.get("images") for r in rows):
        from areal_cli.models.vl_inputs import image_features, image_processor_for

        if tokenizer is None:
            raise ValueError("rows with images need the tokenizer (its model dir's image processor)")
        proc = image_processor_for(tokenizer)
        traj.data["multi_modal"] = [image_features(proc, r["images"])[0] if r.get("images") else None
                                    for r in rows]
    return traj
