"""Shared test doubles for the rollout-executor tests (no tests here).

``FakeEngine`` implements the InferenceEngine ABC in-process: it "generates" deterministic tokens with a
small per-token delay, stamps each token with the version it holds at that moment, and honours
pause/continue the way the real client does (a paused request waits and then resumes, so one response
can span versions). It is the *dependency* of the executor under test, not the thing under test.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal_cli.api.inference_api import InferenceEngine
from areal_cli.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.rollout.workflows.common import Segment, build_row, stack_rows


def fake_token(prompt: list[int], pos: int) -> int:
    return 10 + (sum(prompt) * 7 + pos * 13) % 50


def fake_logprob(token: int, pos: int) -> float:
    return -0.01 * ((token + pos) % 17 + 1)


class FakeEngine(InferenceEngine):
    def __init__(self, token_delay: float = 0.001, eos_token_id: int | None = None):
        self.version = 0
        self.token_delay = token_delay
        self.eos_token_id = eos_token_id
        self.paused = False
        self.n_requests = 0
        self.n_resumes_total = 0
        self.max_inflight = 0
        self._inflight = 0
        self.scripted: list[list[int]] = []  # if set, each request pops one output sequence

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.n_requests += 1
        self._inflight += 1
        self.max_inflight = max(self.max_inflight, self._inflight)
        try:
            script = self.scripted.pop(0) if self.scripted else None
            n = len(script) if script is not None else req.gconfig.max_new_tokens
            toks: list[int] = []
            lps: list[float] = []
            vers: list[int] = []
            resumes = 0
            stop = "length"
            for pos in range(n):
                if self.paused:
                    resumes += 1
                    while self.paused:
                        await asyncio.sleep(0.001)
                await asyncio.sleep(self.token_delay)
                tok = script[pos] if script is not None else fake_token(req.input_ids, pos)
                toks.append(tok)
                lps.append(fake_logprob(tok, pos))
                vers.append(self.version)
                if tok in req.gconfig.stop_token_ids:
                    stop = "stop"
                    break
            self.n_resumes_total += resumes
            return ModelResponse(list(req.input_ids), toks, lps, vers, stop, n_resumes=resumes)
        finally:
            self._inflight -= 1

    async def pause_generation(self) -> None:
        self.paused = True

    async def continue_generation(self) -> None:
        self.paused = False

    async def update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        self.version = meta.version

    async def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        raise NotImplementedError("the fake engine has no distributed weight transport")

    async def update_weights_from_distributed(self, meta, specs) -> None:
        raise NotImplementedError("the fake engine has no distributed weight transport")

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    @property
    def addresses(self) -> list[str]:
        return ["fake:0"]


class LengthWorkflow(RolloutWorkflow):
    """One sample per item: prompt ``data["prompt_ids"]``, ``data["len"]`` new tokens, reward
    ``data["reward"]`` (or one row per entry of ``data["rewards"]``).
    ``data["fail"]`` raises; ``data["reject"]`` returns None."""

    async def arun_episode(self, engine, data: dict[str, Any]) -> Trajectory | None:
        if data.get("fail"):
            raise ValueError("episode exploded")
        from areal_cli.api.io_struct import GenerationConfig

        resp = await engine.agenerate(ModelRequest(list(data["prompt_ids"]),
                                                   GenerationConfig(max_new_tokens=int(data["len"]))))
        if data.get("reject"):
            return None
        row = build_row([Segment(list(data["prompt_ids"])),
                         Segment(resp.output_tokens, resp.output_logprobs, resp.output_versions)])
        rewards = data.get("rewards", [float(data.get("reward", 0.0))])
        rows = [row] * len(rewards)
        return stack_rows(rows, list(rewards), [resp.stop_reason == "length"] * len(rewards),
                          int(data.get("gid", 0)), 0, {"item": data.get("id")})
