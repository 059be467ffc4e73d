"""The hf server's rollout fast paths against the old ones, over real HTTP: ASGI ``/generate`` vs the
FastAPI route (same bytes for errors, same schema), shared-prompt prefill and seeded sampling
(a GRPO-shaped batch gives each seed the same tokens however it is batched), client disconnects."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from hf_server_helpers import load_model, prompts, teacher_forced_logprobs

# The old paths: the FastAPI /generate route is the server's; independent prefill and generator sampling
# are the benchmark's baselines (benchmarks/hf_baseline.py), no longer in the product.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from hf_baseline import launch as launch_hf  # noqa: E402

OLD = ["--generate-endpoint", "fastapi", "--no-shared-prefill", "--seeded-sampling", "generator"]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("logs"))
    hs = {}
    try:
        for name, extra in (("new", []), ("old", OLD)):
            hs[name] = launch_hf(tiny_model_dir, ["--num-threads", "1", *extra], log_dir=logs, timeout_s=180,
                                 env={"OMP_NUM_THREADS": "1"})
        yield hs
    finally:
        for h in hs.values():
            h.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


BAD = ["{not json", "", json.dumps([1]), json.dumps({"input_ids": [1, 2], "stream": True}),
       json.dumps({"input_ids": [1, 2], "return_logprob": "yes"}),
       json.dumps({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}),
       json.dumps({"input_ids": [[1, 2], []]}), json.dumps({"text": ""})]


def test_errors_and_greedy_responses_are_identical_on_both_endpoints(servers):
    for body in BAD:
        rs = [httpx.post(f"http://{h.address}/generate", content=body, timeout=30,
                         headers={"content-type": "application/json"}) for h in servers.values()]
        assert rs[0].status_code == rs[1].status_code == 400, body
        assert rs[0].content == rs[1].content and rs[0].headers["content-type"] == rs[1].headers["content-type"]
    req = {"input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True, "rid": "x",
           "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
    outs = [httpx.post(f"http://{h.address}/generate", json=req, timeout=60).json() for h in servers.values()]
    volatile = {"id", "e2e_latency", "ttft"}
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        assert a["meta_info"].keys() == b["meta_info"].keys()
        for k in a["meta_info"].keys() - volatile - {"output_token_logprobs"}:
            assert a["meta_info"][k] == b["meta_info"][k], k
        lp_a, lp_b = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [x[1:] for x in lp_a] == [x[1:] for x in lp_b]
        assert max(abs(x[0] - y[0]) for x, y in zip(lp_a, lp_b)) < 1e-5
    assert httpx.get(f"http://{servers['new'].address}/generate", timeout=10).status_code == 405


async def _grpo_batch(address: str, ps: list[list[int]], group: int, seed0: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*[c.post(f"http://{address}/generate", json={
            "input_ids": p, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                                "sampling_seed": seed0 + i * group + k}})
            for i, p in enumerate(ps) for k in range(group)])
    return [r.json() for r in rs]


def test_grpo_batch_is_seed_deterministic_and_shares_prefill(servers, tok, tiny_model_dir):
    ps = prompts(tok, 3, seed=21)
    addr = servers["new"].address
    before = httpx.get(f"http://{addr}/get_load", timeout=10).json()["stats"]
    batch = asyncio.run(_grpo_batch(addr, ps, 4, 500))
    stats = httpx.get(f"http://{addr}/get_load", timeout=10).json()["stats"]
    shared = stats["shared_prefill_tokens"] - before["shared_prefill_tokens"]
    computed = stats["prefill_tokens"] - before["prefill_tokens"]
    cached = stats["cached_prefill_tokens"] - before["cached_prefill_tokens"]  # from the prefix cache
    assert shared + computed + cached == 4 * sum(len(p) for p in ps) and shared > 0
    assert sum(o["meta_info"]["cached_tokens"] for o in batch) == shared + cached
    # Each seed alone (no sharing, batch of one) gives the same tokens; logprobs are the model's.
    model = load_model(tiny_model_dir)
    for j in (0, 1, 5, 11):
        i = j // 4
        alone = asyncio.run(_grpo_batch(addr, [ps[i]], 1, 500 + j))[0]
        assert alone["output_ids"] == batch[j]["output_ids"]
        want = teacher_forced_logprobs(model, ps[i], batch[j]["output_ids"])
        got = [x[0] for x in batch[j]["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert len({tuple(o["output_ids"]) for o in batch[:4]}) > 1  # one prompt, four seeds


def test_client_disconnect_frees_the_slot(servers):
    """A caller that hangs up frees its slot. The server is paused, so the request cannot finish before
    the client gives up, however fast the machine: the test observes the cancellation, not a race."""
    addr = servers["new"].address
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}

    def load() -> dict:
        return httpx.get(f"http://{addr}/get_load", timeout=10).json()

    gen0, fin0 = load()["stats"]["generated_tokens"], load()["stats"]["finished"]
    assert httpx.post(f"http://{addr}/pause_generation", json={}, timeout=10).status_code == 200
    try:
        with pytest.raises(httpx.TimeoutException):  # held by the pause: no answer can come
            httpx.post(f"http://{addr}/generate", json=body, timeout=2.0)
        deadline = time.monotonic() + 20
        while load()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        paused = load()
        assert paused["paused"] and paused["waiting"] == 0 and paused["running"] == 0, paused
        assert paused["stats"]["finished"] == fin0 + 1, "the dropped request was never finished"
    finally:
        httpx.post(f"http://{addr}/continue_generation", json={}, timeout=10)
    after = load()
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["stats"]["generated_tokens"] == gen0, "a hung-up request still generated"
    ok = httpx.post(f"http://{addr}/generate", timeout=60,
                    json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4


def test_client_group_call_matches_one_call_per_sample(servers, tok):
    """``agenerate_group`` (one batched /generate with a sampling_params list) gives every seeded sample
    the tokens, logprobs and versions that one ``agenerate`` per sample gives."""
    from areal_cli.api.io_struct import GenerationConfig, ModelRequest
    from areal_cli.inference.client import RemoteInferenceEngine

    p = prompts(tok, 1, seed=5)[0]
    reqs = [ModelRequest(input_ids=list(p), gconfig=GenerationConfig(max_new_tokens=12 + k % 3, seed=900 + k))
            for k in range(6)]
    eng = RemoteInferenceEngine([servers["new"].address], "hf")

    async def both():
        return await eng.agenerate_group(reqs), [await eng.agenerate(r) for r in reqs]

    group, single = asyncio.run(both())
    for g, s in zip(group, single, strict=True):
        assert g.output_tokens == s.output_tokens and g.stop_reason == s.stop_reason
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, s.output_logprobs)) < 1e-4
        assert g.output_versions == s.output_versions
    assert len({tuple(g.output_tokens) for g in group}) > 1
    bad = httpx.post(f"http://{servers['new'].address}/generate", timeout=10,
                     json={"input_ids": [p], "sampling_params": [{}, {}]})
    assert bad.status_code == 400 and "sampling_params is a list of 2" in bad.text
