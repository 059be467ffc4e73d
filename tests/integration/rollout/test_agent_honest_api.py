"""The agent layer's API contract against a real ``hf`` server process: bad requests are the status the
server gives (never a 500) through the proxy and the in-process client, the connection stays usable; a
turn that stopped on a stop string or EOS is closed in the next prompt exactly as the template closes
it; ``logprobs`` is honoured (real SDK objects) and ``top_logprobs`` refused by name."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
from agent_helpers import ADD_TOOL, make_tool_model, question
from hf_server_helpers import load_model, start_hf_server, teacher_forced_logprobs

CONTEXT = 512  # the server's context length: small, so that an oversize prompt is cheap to build


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    return make_tool_model(tiny_model_dir, str(tmp_path_factory.mktemp("tool_model")))


@pytest.fixture(scope="module")
def server(tool_model_dir, tmp_path_factory):
    h = start_hf_server(tool_model_dir, tmp_path_factory, context_length=CONTEXT)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tok(tool_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model_dir)


def _engine(server, **kw):
    from areal_cli.inference.client import RemoteInferenceEngine

    return RemoteInferenceEngine([server.address], "hf", timeout_s=120, **kw)


@pytest.fixture(scope="module")
def proxy(server, tok):
    from areal_cli.rollout.proxy import AgentProxy, serve_proxy

    p = serve_proxy(AgentProxy(_engine(server), tok, admin_key="admin-secret"))
    yield p
    p.stop()


def _session_key(p) -> str:
    hdr = {"Authorization": "Bearer admin-secret"}
    assert httpx.post(f"http://{p.address}/rl/grant_capacity", json={}, headers=hdr).status_code == 200
    return httpx.post(f"http://{p.address}/rl/start_session", json={}, headers=hdr).json()["api_key"]


GOOD = {"model": "policy", "messages": question(3, 4), "max_tokens": 8, "temperature": 0}
TOOL_TURN = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
# (what is wrong, create() arguments over GOOD, the status, words of the message)
BAD = [
    ("oversize prompt", {"messages": [{"role": "user", "content": "one two three " * 50}]}, 400,
     "context length"),
    ("prompt + max_tokens over the context", {"max_tokens": CONTEXT}, 400, "exceeds the context length"),
    ("tools not a list", {"tools": "add"}, 400, "tools must be"),
    ("tool without a function", {"tools": [{"type": "function"}]}, 400, "tools must be"),
    ("forced tool choice", {"tools": [ADD_TOOL], "tool_choice": "required"}, 400, "not supported"),
    ("empty messages", {"messages": []}, 400, "non-empty list"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role in"),
    ("message without content", {"messages": [{"role": "user"}]}, 400, "content is required"),
    ("tool turn without its call id", {"messages": question(1, 2) + TOOL_TURN + [{"role": "tool", "content": "3"}]},
     400, "tool_call_id"),
    ("content of the wrong type", {"messages": [{"role": "user", "content": 7}]}, 400, "content must be"),
    ("model not a string", {"model": 123}, 400, "model must be a string"),
    ("temperature not a number", {"temperature": "hot"}, 400, "temperature must be"),
    ("negative max_tokens", {"max_tokens": -1}, 400, ">= 0"),
    ("stop not strings", {"stop": [1]}, 400, "stop must be"),
    ("seed not an integer", {"seed": "x"}, 400, "seed must be"),
    ("n > 1", {"n": 2}, 400, "one completion per call"),
    ("a penalty", {"frequency_penalty": 0.5}, 400, "not supported"),
    ("logprobs not a boolean", {"extra_body": {"logprobs": "yes"}}, 400, "logprobs must be a boolean"),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 3}, 400, "top_logprobs=3 is not supported"),
]


def test_bad_requests_through_proxy_are_4xx_and_the_connection_stays(proxy, caplog):
    """Each bad request is the server's 4xx with its message through the real openai client; a good
    request on the same client (the same kept-alive connection) succeeds after each one."""
    c = openai.OpenAI(base_url=proxy.base_url, api_key=_session_key(proxy), max_retries=0)
    streams = []
    with caplog.at_level(logging.ERROR):
        for what, kw, status, words in BAD:
            with pytest.raises(openai.APIStatusError) as ei:
                c.chat.completions.create(**{**GOOD, **kw})
            e = ei.value
            assert e.status_code == status and words in e.message, (what, e.status_code, e.message)
            streams.append(e.response.extensions.get("network_stream"))
            ok = c.chat.completions.with_raw_response.create(**GOOD)
            assert ok.status_code == 200, what
            assert ok.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")
            streams.append(ok.http_response.extensions.get("network_stream"))
    assert None not in streams and all(s is streams[0] for s in streams), "a bad request dropped the connection"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a bad request logged an error"
    # the proxy's own body checks, on raw HTTP
    key = c.api_key
    with httpx.Client(base_url=f"http://{proxy.address}", headers={"Authorization": f"Bearer {key}"}) as h:
        for raw, words in ((b"{not json", "malformed JSON"), (json.dumps({"max_tokens": 4}), "messages must be"),
                           (json.dumps({**GOOD, "extra_body": {}}), "extra_body")):
            r = h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert h.post("/v1/chat/completions", json=GOOD).status_code == 200


def test_in_process_errors_are_the_sdk_exceptions(server, tok):
    from areal_cli.inference.client import RequestRejected
    from areal_cli.rollout.episodes import is_transport_error
    from areal_cli.rollout.openai_client import ArealOpenAI
    from areal_cli.utils.network import find_free_port

    async def go():
        client = ArealOpenAI(_engine(server), tok)
        long = [{"role": "user", "content": "one two three " * 50}]
        with pytest.raises(openai.BadRequestError, match="context length") as ei:
            await client.chat.completions.create(model="m", messages=long, max_tokens=4)
        # the server's refusal, with its status and message, is the cause; it is no transport error
        assert isinstance(ei.value.__cause__, RequestRejected) and ei.value.status_code == 400
        assert ei.value.message == ei.value.__cause__.server_message and not is_transport_error(ei.value)
        with pytest.raises(openai.BadRequestError, match="tools must be"):
            await client.chat.completions.create(model="m", messages=question(1, 2), tools=[{"name": "add"}])
        with pytest.raises(openai.BadRequestError, match="input must be"):
            await client.responses.create(model="m", input=5)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            await client.responses.create(model="m", input="hi", top_logprobs=2)
        ok = await client.chat.completions.create(model="m", messages=question(1, 2), max_tokens=4)
        assert len(client.cache) == 1 and ok.id == client.cache.last.id  # refused calls left no trace
        # a server that is down: the SDK's 5xx, and episode retries still see a transport failure
        dead = ArealOpenAI(_dead_engine(find_free_port("127.0.0.1")), tok)
        with pytest.raises(openai.InternalServerError) as ei:
            await dead.chat.completions.create(model="m", messages=question(1, 2), max_tokens=4)
        assert ei.value.status_code == 502 and is_transport_error(ei.value)

    asyncio.run(go())


def _dead_engine(port: int):
    from areal_cli.inference.client import RemoteInferenceEngine

    return RemoteInferenceEngine([f"127.0.0.1:{port}"], "hf", timeout_s=10, retries=0)


# ------------------------------------------------------------------------------ closing a turn
def test_stop_string_and_eos_close_the_turn_as_the_template_does(server, tok):
    """The next call's prompt is the template's rendering of the conversation with the text the
    model wrote: after EOS as the model closed it, after a stop string with the end-of-turn token added
    (loss mask 0), not ``...output\\n<|im_start|>user``."""
    from areal_cli.rollout.openai_client import ArealOpenAI

    eos = tok.eos_token_id

    def render(msgs):
        return list(tok.apply_chat_template(msgs, tools=[ADD_TOOL], add_generation_prompt=True,
                                            tokenize=True)["input_ids"])

    async def call(client, msgs, **kw):
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], temperature=0,
                                                 max_tokens=80, **kw)
        return r, client.cache.last

    async def go(client):
        msgs = question(3, 4)
        r, first = await call(client, msgs)  # the tool model calls the tool and stops at its EOS
        assert r.choices[0].finish_reason == "tool_calls" and first.output_ids[-1] == eos
        call_ = r.choices[0].message.tool_calls[0]
        msgs = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call_.id, "content": "7"}]
        _, second = await call(client, msgs)
        assert second.token_parent_id == first.id
        assert second.input_ids == render(msgs) and not second.retokenized  # EOS: nothing added twice
        # the same turn again, stopped on a stop string inside what it writes ("The answer is 7.")
        r3, third = await call(client, msgs, stop=["answer"])
        assert r3.choices[0].finish_reason == "stop" and r3.choices[0].message.content == "The "
        assert third.stop_reason == "stop" and third.output_ids[-1] != eos
        after = [{"role": "user", "content": "Go on"}]
        _, fourth = await call(client, msgs + [r3.choices[0].message.model_dump(exclude_none=True)] + after)
        assert fourth.token_parent_id == third.id and fourth.retokenized  # the content left "answer" out
        wrote = tok.decode(third.output_ids)  # the text the model wrote, the stop string included
        assert wrote.startswith("The answer")
        assert fourth.input_ids == render(msgs + [{"role": "assistant", "content": wrote}] + after)
        real = third.input_ids + third.output_ids
        assert fourth.input_ids[:len(real) + 1] == real + [eos]
        return third, fourth

    client = ArealOpenAI(_engine(server), tok)
    third, fourth = asyncio.run(go(client))
    row = next(r for r in client.export_interactions("per_leaf") if r["ids"][-1] == fourth.id)
    mask = [int(lp is not None) for ids, lp, _ in row["segments"] for _ in ids]
    assert mask[len(third.input_ids) + len(third.output_ids)] == 0  # the added end-of-turn token is not trained
    assert sum(mask[len(third.input_ids):len(third.input_ids) + len(third.output_ids)]) == len(third.output_ids)


# ------------------------------------------------------------------------------------ logprobs
def test_logprobs_in_process_and_through_the_proxy(server, tok, tool_model_dir, proxy):
    from openai.types.chat.chat_completion import ChoiceLogprobs

    from areal_cli.rollout.openai_client import ArealOpenAI

    model = load_model(tool_model_dir)
    msgs = question(2, 5)

    def check(choice, prompt_ids):
        lp = choice.logprobs
        assert isinstance(lp, ChoiceLogprobs)
        ids = choice.model_extra["token_ids"]
        assert [t.token for t in lp.content] == [tok.decode([i]) for i in ids]
        assert all(t.top_logprobs == [] for t in lp.content)
        assert [t.logprob for t in lp.content] == pytest.approx(teacher_forced_logprobs(model, prompt_ids, ids),
                                                                abs=1e-3)

    async def in_process():
        client = ArealOpenAI(_engine(server), tok)
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], max_tokens=40,
                                                 temperature=0, logprobs=True, top_logprobs=0)
        plain = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
        return r, plain, client

    r, plain, client = asyncio.run(in_process())
    check(r.choices[0], r.model_extra["prompt_token_ids"])
    assert [t.logprob for t in r.choices[0].logprobs.content] == list(client.cache[r.id].logprobs)
    assert plain.choices[0].logprobs is None  # not asked: not given
    # the proxy: the real SDK's parsed objects, plain and streamed
    c = openai.OpenAI(base_url=proxy.base_url, api_key=_session_key(proxy), max_retries=0)
    p = c.chat.completions.create(model="policy", messages=msgs, max_tokens=12, temperature=0, logprobs=True)
    check(p.choices[0], p.model_extra["prompt_token_ids"])
    chunks = list(c.chat.completions.create(model="policy", messages=msgs, max_tokens=12, temperature=0,
                                            logprobs=True, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in p.choices[0].logprobs.content]


# ------------------------------------------------------------------------ fields beyond the named ones
# (field, value, None: accepted (no effect on generation by OpenAI's semantics) | words of the 400)
FIELDS = [
    ("user", "user-7", None), ("metadata", {"run": "a"}, None), ("store", True, None),
    ("service_tier", "auto", None), ("prompt_cache_key", "k", None), ("safety_identifier", "s", None),
    ("modalities", ["text"], None),
    ("presence_penalty", 0.5, "presence_penalty=0.5 is not supported"),
    ("frequency_penalty", 0.5, "frequency_penalty=0.5 is not supported"),
    ("logit_bias", {"5": 10}, "logit_bias is not supported"),
    ("response_format", {"type": "json_object"}, "response_format other than"),
    ("reasoning_effort", "low", "reasoning_effort='low' is not supported"),
    ("verbosity", "low", "verbosity='low' is not supported"),
    ("functions", [{"name": "add"}], "functions=[{'name': 'add'}] is not supported: use tools"),
    ("function_call", "auto", "function_call='auto' is not supported"),
    ("modalities", ["text", "audio"], "modalities=['text', 'audio'] is not supported"),
    ("top_k", 5, "top_k=5 is not supported"),
    ("tool_call_parser", "qwen3", "tool_call_parser='qwen3' is not supported"),
]


def test_request_fields_are_honoured_or_refused_alike(server, tok, proxy):
    """Every chat-completion field beyond the named parameters is either accepted (no effect on what is
    generated) or a 400 naming it, with the same message in-process (as a keyword argument) and
    through the proxy (the real openai client, the field in the body)."""
    from areal_cli.rollout.openai_client import ArealOpenAI

    ask = {**GOOD, "max_tokens": 2}

    def outcome(r):
        if isinstance(r, openai.APIStatusError):  # the SDK prefixes a server's message with its status
            return r.status_code, r.message.removeprefix(f"Error code: {r.status_code} - ")
        return 200, r.choices[0].finish_reason in ("stop", "length")

    async def in_process():
        client, out = ArealOpenAI(_engine(server), tok), []
        for field, value, _ in FIELDS:
            try:
                out.append(await client.chat.completions.create(**ask, **{field: value}))
            except openai.APIStatusError as e:
                out.append(e)
        # the SDK's extra_body reaches the in-process client as it reaches a server: at the top level
        with pytest.raises(openai.BadRequestError, match="top_k=3"):
            await client.chat.completions.create(**ask, extra_body={"top_k": 3})
        return out, len(client.cache)

    here, stored = asyncio.run(in_process())
    assert stored == sum(words is None for *_, words in FIELDS)  # refused calls leave no trace
    sdk = openai.OpenAI(base_url=proxy.base_url, api_key=_session_key(proxy), max_retries=0)
    for (field, value, words), r in zip(FIELDS, here):
        try:
            there = sdk.chat.completions.create(**ask, extra_body={field: value})
        except openai.APIStatusError as e:
            there = e
        assert outcome(r) == outcome(there), (field, outcome(r), outcome(there))
        if words is None:
            assert outcome(r) == (200, True), field
        else:
            assert outcome(r)[0] == 400 and words in outcome(r)[1], (field, outcome(r))
