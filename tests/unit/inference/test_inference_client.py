"""RemoteInferenceEngine against real in-process HTTP servers that misbehave on purpose:
5xx retried with backoff, 4xx raised at once, aborts resumed with the remaining budget, routing."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_cli.api.io_struct import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.utils.network import find_free_port


class ScriptedServer:
    """An SGLang-shaped server: fails ``fail_first`` calls with 503, aborts every ``abort_every`` tokens."""

    def __init__(self, fail_first: int = 0, abort_after: int | None = None, version: int = 0):
        self.calls: list[dict] = []
        self.fail_first = fail_first
        self.abort_after = abort_after
        self.version = version
        self.admin: list[str] = []
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.calls.append(body)
            if len(self.calls) <= self.fail_first:
                return JSONResponse({"error": "overloaded"}, status_code=503)
            if body["input_ids"][0] == 999:
                return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
            if isinstance(body["input_ids"][0], list):  # SGLang's batch form
                outs = [self._answer(ids, sp) for ids, sp in zip(body["input_ids"], body["sampling_params"],
                                                                  strict=True)]
                if any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs):
                    self.version += 1
                return outs
            out = self._answer(body["input_ids"], body["sampling_params"])
            if out["meta_info"]["finish_reason"]["type"] == "abort":
                self.version += 1
            return out

        @app.get("/health")
        async def health():
            return {}

        for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
            async def admin(request: Request, _p=path):
                self.admin.append(_p)
                return {"success": True, "message": "ok"}

            app.post(path)(admin)
        self.port = find_free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _answer(self, input_ids: list[int], sp: dict) -> dict:
        want = sp["max_new_tokens"]
        n = want if self.abort_after is None else min(want, self.abort_after)
        start = len(input_ids)
        toks = [start + i for i in range(n)]  # token = its absolute position: checks contiguity
        return {"output_ids": toks, "meta_info": {
            "finish_reason": {"type": "length" if n == want else "abort"}, "weight_version": str(self.version),
            "output_token_logprobs": [[-0.01 * t, t, None] for t in toks]}}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _req(n=10, first=1):
    return ModelRequest(input_ids=[first, 2, 3], gconfig=GenerationConfig(max_new_tokens=n))


def test_5xx_is_retried_with_backoff_then_succeeds():
    with ScriptedServer(fail_first=2) as s:
        eng = RemoteInferenceEngine([s.address], "sglang", retries=3, backoff_s=0.01)
        r = asyncio.run(eng.agenerate(_req(5)))
        assert r.output_tokens == [3, 4, 5, 6, 7] and r.stop_reason == "length" and len(s.calls) == 3


def test_retries_exhausted_raise():
    with ScriptedServer(fail_first=10) as s:
        eng = RemoteInferenceEngine([s.address], "sglang", retries=1, backoff_s=0.01)
        with pytest.raises(InferenceError, match="503"):
            asyncio.run(eng.agenerate(_req(5)))
        assert len(s.calls) == 2


def test_4xx_is_not_retried():
    with ScriptedServer() as s:
        eng = RemoteInferenceEngine([s.address], "sglang", retries=3, backoff_s=0.01)
        with pytest.raises(InferenceError, match="bad prompt"):
            asyncio.run(eng.agenerate(_req(5, first=999)))
        assert len(s.calls) == 1


def test_abort_is_resumed_with_remaining_budget_and_versions():
    with ScriptedServer(abort_after=4, version=5) as s:
        eng = RemoteInferenceEngine([s.address], "sglang", backoff_s=0.01)
        r = asyncio.run(eng.agenerate(_req(10)))
        assert r.stop_reason == "length" and r.n_resumes == 2
        assert r.output_tokens == list(range(3, 13))  # contiguous positions across three segments
        assert r.output_logprobs == [-0.01 * t for t in range(3, 13)]
        assert r.output_versions == [5] * 4 + [6] * 4 + [7] * 2
        budgets = [c["sampling_params"]["max_new_tokens"] for c in s.calls]
        assert budgets == [10, 6, 2]
        assert s.calls[1]["input_ids"] == [1, 2, 3, 3, 4, 5, 6]


@pytest.mark.parametrize("backend", ["sglang", "hf"])
def test_group_is_one_batched_call_per_round_with_per_row_resume(backend):
    """Rows of different lengths and budgets in one call; aborted rows resume together, finished
    ones drop out, and each row ends exactly as agenerate would have ended it."""
    reqs = [ModelRequest(input_ids=[1] * (3 + i), gconfig=GenerationConfig(max_new_tokens=n))
            for i, n in enumerate([10, 3, 6])]
    with ScriptedServer(abort_after=4, version=5) as s:
        eng = RemoteInferenceEngine([s.address], backend, backoff_s=0.01)
        assert eng.supports_batch_generate
        out = asyncio.run(eng.agenerate_group(reqs))
    assert [len(c["input_ids"]) for c in s.calls] == [3, 2, 1]  # rows per round: 3, then 2, then 1
    assert [c["sampling_params"][0]["max_new_tokens"] for c in s.calls] == [10, 6, 2]
    for i, (r, n) in enumerate(zip(out, [10, 3, 6])):
        assert r.stop_reason == "length" and r.output_tokens == list(range(3 + i, 3 + i + n))
        assert r.output_logprobs == [-0.01 * t for t in r.output_tokens]
    assert out[0].output_versions == [5] * 4 + [6] * 4 + [7] * 2 and out[0].n_resumes == 2
    assert out[1].output_versions == [5] * 3 and out[1].n_resumes == 0
    assert out[2].output_versions == [5] * 4 + [6] * 2 and out[2].n_resumes == 1


def test_least_loaded_routing_spreads_and_admin_reaches_every_server(tmp_path):
    with ScriptedServer() as a, ScriptedServer() as b:
        eng = RemoteInferenceEngine([a.address, b.address], "sglang", routing="least_loaded")

        async def go():
            await asyncio.gather(*[eng.agenerate(_req(3)) for _ in range(20)])
            await eng.pause_generation()
            await eng.update_weights_from_disk(WeightUpdateMeta(type="disk", version=2, path=str(tmp_path)))
            await eng.continue_generation()

        asyncio.run(go())
        assert len(a.calls) + len(b.calls) == 20 and min(len(a.calls), len(b.calls)) >= 5
        for s in (a, b):
            assert s.admin == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert eng.get_version() == 2
