"""Real-HTTP tests of the built-in hf server: generation correctness, batching, pause, OpenAI, bad input."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from hf_server_helpers import hf_greedy, load_model, prompts, start_hf_server, teacher_forced_logprobs

from areal_cli.api.io_struct import GenerationConfig, ModelRequest
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.utils.network import find_free_port


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()
    assert not h.alive()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _gen(address: str, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"http://{address}/generate", json=body, timeout=timeout)


def test_logprobs_equal_teacher_forced_forward(server, model, tok):
    for i, (p, temp) in enumerate(zip(prompts(tok, 3, seed=1), [0.7, 1.0, 1.3])):
        r = _gen(server.address, {"input_ids": p, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 24, "temperature": temp, "top_p": 0.9,
                                                      "ignore_eos": True}})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        out = [t for _, t, _ in meta["output_token_logprobs"]]
        got = [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert out == r.json()["output_ids"] and len(out) == 24
        want = teacher_forced_logprobs(model, p, out, temperature=temp)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_greedy_equals_hf_generate_under_concurrency(server, model, tok):
    ps = prompts(tok, 6, seed=2)
    lens = [8, 30, 17, 40, 5, 23]

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(f"http://{server.address}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
                for p, n in zip(ps, lens)])
        return [r.json()["output_ids"] for r in rs]

    outs = asyncio.run(go())
    for p, n, out in zip(ps, lens, outs):
        assert out == hf_greedy(model, p, n)


def test_64_concurrent_mixed_requests(server, model, tok):
    distinct = prompts(tok, 16, seed=3)
    ps = [distinct[i % 16] for i in range(64)]
    budgets = [4 + (i * 7) % 37 for i in range(64)]
    # Greedy is deterministic, so a shorter budget's output is a prefix of the longest one's.
    refs = [hf_greedy(model, p, 40) for p in distinct]
    engine = RemoteInferenceEngine([server.address], "hf", timeout_s=300)

    async def go():
        reqs = [ModelRequest(input_ids=p, gconfig=GenerationConfig(greedy=True, max_new_tokens=n))
                for p, n in zip(ps, budgets)]
        return await asyncio.gather(*[engine.agenerate(r) for r in reqs])

    resps = asyncio.run(go())
    for i, (n, resp) in enumerate(zip(budgets, resps)):
        assert resp.stop_reason in ("stop", "length")
        assert resp.output_tokens == refs[i % 16][:n]
        assert len(resp.output_logprobs) == len(resp.output_tokens) == len(resp.output_versions)
        assert set(resp.output_versions) == {0}
    load = httpx.get(f"http://{server.address}/get_load").json()
    assert load["running"] == 0 and load["stats"]["steps"] > 0


def test_pause_aborts_running_and_holds_new_requests(server, tok):
    p = prompts(tok, 1, seed=4)[0]
    base = f"http://{server.address}"

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            long_req = asyncio.create_task(c.post(f"{base}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}))
            for _ in range(400):  # wait until it is decoding
                await asyncio.sleep(0.01)
                if (await c.get(f"{base}/get_load")).json()["running"] == 1:
                    break
            r = await c.post(f"{base}/pause_generation", json={})
            assert r.status_code == 200 and r.json()["num_aborted"] == 1
            aborted = (await long_req).json()
            assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(aborted["output_ids"]) < 600
            held = asyncio.create_task(c.post(f"{base}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}))
            done, _ = await asyncio.wait({held}, timeout=1.5)
            assert not done, "a request completed while the server was paused"
            assert (await c.get(f"{base}/get_load")).json()["waiting"] == 1
            r = await c.post(f"{base}/continue_generation", json={})
            assert r.status_code == 200
            resumed = (await held).json()
            assert resumed["meta_info"]["finish_reason"]["type"] in ("stop", "length")

    asyncio.run(go())


def test_dead_server_is_routed_around(server, tok):
    dead = f"127.0.0.1:{find_free_port()}"
    engine = RemoteInferenceEngine([dead, server.address], "hf", timeout_s=60, retries=3, routing="round_robin",
                                   backoff_s=0.05)

    async def go():
        outs = []
        for p in prompts(tok, 4, seed=5):
            outs.append(await engine.agenerate(ModelRequest(input_ids=p, gconfig=GenerationConfig(
                greedy=True, max_new_tokens=4))))
        return outs

    outs = asyncio.run(go())
    assert all(o.server == server.address for o in outs)
    assert engine.healthy_addresses() == [server.address]
    engine.set_addresses([server.address])
    assert engine.addresses == [server.address]


def test_openai_completions_and_chat_with_real_client(server, model, tok):
    import openai

    client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    c = client.completions.create(model=name, prompt="What is 3 plus", max_tokens=6, temperature=0, logprobs=0)
    ids = tok("What is 3 plus", add_special_tokens=False)["input_ids"]
    want = hf_greedy(model, ids, 6)
    assert c.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert len(c.choices[0].logprobs.token_logprobs) == len(want)
    msgs = [{"role": "user", "content": "What is 2 plus 2?"}]
    chat = client.chat.completions.create(model=name, messages=msgs, max_tokens=5, temperature=0, logprobs=True)
    cids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    cwant = hf_greedy(model, cids, 5)
    assert chat.choices[0].message.content == tok.decode(cwant, skip_special_tokens=True)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert len(chat.choices[0].logprobs.content) == len(cwant)
    assert chat.usage.prompt_tokens == len(cids)


@pytest.mark.parametrize("body, needle", [
    ("{not json", "malformed JSON"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}}), "max_new_tokens must be int"),
    (json.dumps({"input_ids": "hello"}), "input_ids"),
    (json.dumps({"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}), "unknown sampling_params field"),
    (json.dumps({"input_ids": [1, 10 ** 9]}), "outside the vocabulary"),
    (json.dumps({"input_ids": [5] * 1100}), "context length"),
    (json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 5000}}), "exceeds the context length"),
    (json.dumps({"sampling_params": {}}), "input_ids or text"),
    (json.dumps([1, 2, 3]), "JSON object"),
    (json.dumps({"input_ids": [5, 6], "image_data": ["data:image/png;base64,AAAA"]}), "text-only model"),
])
def test_bad_input_gets_4xx_and_server_keeps_serving(server, body, needle):
    r = httpx.post(f"http://{server.address}/generate", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"]
    ok = _gen(server.address, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) >= 1


def test_non_loopback_bind_requires_api_key(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "areal_cli.inference.hf_server", "--model-path", tiny_model_dir,
                        "--host", "0.0.0.0", "--port", str(find_free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--api-key" in r.stderr


def test_image_content_to_text_only_model_is_400(server):
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"}]}],
        "max_tokens": 2}
    r = httpx.post(f"http://{server.address}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"], r.text
    ok = _gen(server.address, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) >= 1
