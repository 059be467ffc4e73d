"""Rollout workflows give every request of a GRPO group one session id (the inference client routes
them to one server, whose prefix cache then serves the shared prompt) and end it with the group."""

from __future__ import annotations

import asyncio

import pytest
from rollout_fakes import FakeEngine

from areal_cli.api.io_struct import GenerationConfig
from areal_cli.rollout.workflows.multi_turn import MultiTurnWorkflow
from areal_cli.rollout.workflows.rlvr import RLVRWorkflow


class _Recording(FakeEngine):
    def __init__(self):
        super().__init__(token_delay=0)
        self.keys: list[str | None] = []
        self.ended: list[str] = []

    async def agenerate(self, req):
        self.keys.append(req.session_id)
        return await super().agenerate(req)

    def end_session(self, key: str) -> None:
        self.ended.append(key)


async def _reward(prompt: str, completion: str, answer) -> float:
    return 0.0


@pytest.mark.parametrize("kind", ["rlvr", "multi_turn"])
def test_group_members_share_one_session_id_per_episode(tiny_model_dir, kind):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = GenerationConfig(max_new_tokens=3)
    wf = (RLVRWorkflow(_reward, g, tok, group_size=4) if kind == "rlvr"
          else MultiTurnWorkflow(_reward, g, tok, group_size=3, max_turns=2))
    eng = _Recording()
    for _ in range(2):
        asyncio.run(wf.arun_episode(eng, {"prompt": "What is 2+3?", "answer": "5"}))
    n = len(eng.keys) // 2
    first, second = set(eng.keys[:n]), set(eng.keys[n:])
    assert len(first) == len(second) == 1 and first != second  # one id per group, a new one per group
    assert next(iter(first)).startswith("group-") and eng.ended == [*first, *second]
