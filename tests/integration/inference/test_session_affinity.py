"""Session-affine routing over two real hf servers with their prefix caches: every call of a session
(an agent's in-process OpenAI client, a GRPO group's id) lands on one server, whose cache serves the
earlier turns with the tokens and logprobs of a full prefill; when that server dies the session goes
on on the other; a weight-version change drops the cache."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hf_server_helpers import load_model, start_hf_server, teacher_forced_logprobs

from areal_cli.api.io_struct import GenerationConfig, ModelRequest


@pytest.fixture(scope="module")
def two(tiny_model_dir, tmp_path_factory):
    from areal_cli.inference.launch import wait_until_ready

    hs = []
    try:
        for _ in range(2):  # started together, then waited for: half the start-up time
            hs.append(start_hf_server(tiny_model_dir, tmp_path_factory, extra=["--num-threads", "1"], wait=False))
        for h in hs:
            wait_until_ready(h.address, 180, h.proc, h.log_path)
        yield hs
    finally:
        for h in hs:
            h.stop()


def _stats(address: str) -> dict:
    return httpx.get(f"http://{address}/get_load", timeout=30).json()["stats"]


def test_sessions_stick_to_one_server_reuse_its_cache_and_fail_over(two, tiny_model_dir):
    from areal_cli.inference.client import RemoteInferenceEngine

    eng = RemoteInferenceEngine([h.address for h in two], "hf", timeout_s=120, retries=2, backoff_s=0.05)
    g = GenerationConfig(max_new_tokens=8, greedy=True)
    system = list(range(20, 84))  # 64 shared tokens, then each session's own

    async def turns(key: str, first: list[int], n: int, ctx: list[int] | None = None):
        ctx, out = list(ctx or system + first), []
        for t in range(n):
            r = await eng.agenerate(ModelRequest(input_ids=list(ctx), gconfig=g, session_id=key))
            out.append(r)
            ctx += list(r.output_tokens) + [5 + t, 6 + t, 7]
        return ctx, out

    async def phase1():
        # Six sessions at once: least_loaded spreads them, affinity keeps each on its first server.
        return await asyncio.gather(*(turns(f"s{i}", [90 + i, 91, 92], 3) for i in range(6)))

    before = {h.address: _stats(h.address) for h in two}
    res = asyncio.run(phase1())
    homes = [{r.server for r in out} for _, out in res]
    assert all(len(h) == 1 for h in homes), homes
    assert len({next(iter(h)) for h in homes}) == 2  # both servers got sessions
    assert [eng.session_server(f"s{i}") for i in range(6)] == [next(iter(h)) for h in homes]
    # Each server's cache served the later turns: of the prompt tokens it saw, most were copied, not computed.
    for h in two:
        s, b = _stats(h.address), before[h.address]
        cached = s["cached_prefill_tokens"] - b["cached_prefill_tokens"]
        computed = s["prefill_tokens"] - b["prefill_tokens"]
        assert cached > computed > 0 and s["prefix_cache_entries"] > 0
    # Cached turns decode exactly what a full forward gives (teacher-forced logprobs, fp32 tolerance).
    model = load_model(tiny_model_dir)
    for _, out in res[:2]:
        r = out[-1]
        ref = teacher_forced_logprobs(model, list(r.input_tokens), list(r.output_tokens))
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4

    # The in-process OpenAI client sends every call of its session with its own id.
    from transformers import AutoTokenizer

    from areal_cli.rollout.openai_client import ArealOpenAI

    client = ArealOpenAI(eng, AutoTokenizer.from_pretrained(tiny_model_dir), default_max_tokens=4)

    async def chat():
        msgs = [{"role": "user", "content": "What is 2 plus 3?"}]
        for _ in range(2):
            r = await client.chat.completions.create(messages=msgs, model="m", temperature=0)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Again."}]

    asyncio.run(chat())
    assert eng.session_server(client.session_id) in {h.address for h in two}

    # A weight-version change drops the cache of that server.
    home = eng.session_server("s0")
    httpx.post(f"http://{home}/update_weight_version", json={"new_version": 1}, timeout=30).raise_for_status()
    assert _stats(home)["prefix_cache_tokens"] == 0

    # The session's server dies: the session goes on on the other one.
    dead = next(h for h in two if h.address == home)
    dead.stop()
    ctx0 = res[0][0]
    _, more = asyncio.run(turns("s0", [], 2, ctx=ctx0))
    other = next(h.address for h in two if h.address != home)
    assert {r.server for r in more} == {other} and eng.session_server("s0") == other
    eng.end_session("s0")
    assert eng.session_server("s0") is None
