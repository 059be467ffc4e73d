"""Agentic RL through the OpenAI API against real ``hf`` servers: the RL-safe routes, the in-process
client (raw SDK calls and the OpenAI Agents SDK), the proxy (the real ``openai`` client and LangChain),
weight updates landing mid-call, and retokenization drift."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from agent_helpers import ADD_TOOL, SYSTEM, make_tool_model, question, qwen3_tokenizer
from hf_server_helpers import start_hf_server
from support_paths import SUPPORT


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    return make_tool_model(tiny_model_dir, str(tmp_path_factory.mktemp("tool_model")))


@pytest.fixture(scope="module")
def tool_server(tool_model_dir, tmp_path_factory):
    h = start_hf_server(tool_model_dir, tmp_path_factory)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def random_server(tiny_model_dir, tmp_path_factory):
    """The untrained tiny model: it rarely emits its end-of-turn token, so generations run long."""
    h = start_hf_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tok(tool_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model_dir)


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0)


def _engine(server):
    from areal_cli.inference.client import RemoteInferenceEngine

    return RemoteInferenceEngine([server.address], "hf", timeout_s=120)


def _generate(server, ids, n):
    r = httpx.post(f"http://{server.address}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    return r.json()["output_ids"]


def add(a: int, b: int) -> int:
    return a + b


# ---------------------------------------------------------------------------------------- routes
def test_rl_safe_routes(tool_server, tok):
    c = _sdk(tool_server)
    name = c.models.list().data[0].id
    msgs = question(3, 4)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        c.chat.completions.create(model=name, messages=msgs, n=0, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2)
    for kw in ({"frequency_penalty": 0.5}, {"presence_penalty": -1.0}, {"logit_bias": {"5": 3}},
               {"tools": [ADD_TOOL], "tool_choice": "required"}):
        with pytest.raises(openai.BadRequestError, match="not supported"):
            c.chat.completions.create(model=name, messages=msgs, max_tokens=2, **kw)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        c.completions.create(model=name, prompt="What is", n=0, max_tokens=2)
    # seed: the same seed gives the same sampled output, on both OpenAI routes
    a, b, other = (c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say"}],
                                             max_tokens=24, temperature=1.0, seed=s,
                                             extra_body={"return_token_ids": True}) for s in (7, 7, 8))
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].model_extra["token_ids"] != other.choices[0].model_extra["token_ids"]
    p1, p2 = (c.completions.create(model=name, prompt="What is", max_tokens=16, temperature=1.0, seed=11)
              for _ in range(2))
    assert p1.choices[0].text == p2.choices[0].text
    # tools go into the chat template; token ids and versions come back through the extra field
    r = c.chat.completions.create(model=name, messages=msgs, tools=[ADD_TOOL], max_tokens=80, temperature=0,
                                  extra_body={"return_token_ids": True})
    want = list(tok.apply_chat_template(msgs, tools=[ADD_TOOL], add_generation_prompt=True,
                                        tokenize=True)["input_ids"])
    plain = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert r.model_extra["prompt_token_ids"] == want != plain
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == _generate(tool_server, want, 80)
    assert ch.model_extra["token_versions"] == [0] * len(ch.model_extra["token_ids"])
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "add"
    # the full round trip: assistant content=None + tool_calls, then a tool turn
    call = ch.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    follow = msgs + [ch.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": str(add(**args))}]
    assert follow[2].get("content") is None
    r2 = c.chat.completions.create(model=name, messages=follow, tools=[ADD_TOOL], max_tokens=30,
                                   temperature=0,
                                   extra_body={"return_token_ids": True})
    assert r2.model_extra["prompt_token_ids"] == list(tok.apply_chat_template(
        follow, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content.startswith("The answer is")
    # a template without tool support is refused instead of dropping the tools silently
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        c.chat.completions.create(model=name, messages=msgs + [{"role": "tool", "content": "5"}],
                                  max_tokens=2)


def test_streaming_tool_calls(tool_server):
    c = _sdk(tool_server)
    chunks = list(c.chat.completions.create(model=c.models.list().data[0].id, messages=question(2, 5),
                                            tools=[ADD_TOOL], max_tokens=80, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["add"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


# ------------------------------------------------------------------------- weight update mid-call
async def _pause_bump_continue(address: str, version: int) -> int:
    """Pause the server while a request runs, bump its version, continue. Returns how many requests the
    pause aborted (0: the request finished first, so the caller tries again). The server always continues:
    a server left paused hangs every later test on it."""
    async with httpx.AsyncClient(timeout=60) as h:
        before = (await h.get(f"http://{address}/get_load")).json()["stats"]["generated_tokens"]
        for _ in range(4000):  # a few tokens decoded at the old version (not a fixed sleep: on a fast idle
            # box 300 tokens take well under 0.1 s, and a sleep let the request finish first)
            load = (await h.get(f"http://{address}/get_load")).json()
            if load["running"] >= 1 and load["stats"]["generated_tokens"] >= before + 4:
                break
            await asyncio.sleep(0.002)
        try:
            n = (await h.post(f"http://{address}/pause_generation", json={})).json()["num_aborted"]
            if n:
                await h.post(f"http://{address}/update_weight_version", json={"new_version": version})
        finally:
            await h.post(f"http://{address}/continue_generation", json={})
        return n


async def _mid_call(make_call, address: str, version: int):
    """``make_call(seed)``'s result from the first of 3 seeds whose request the pause caught running (the
    untrained model can stop at EOS before the pause arrives on a loaded machine)."""
    for seed in (1, 11, 21):
        r, n = await asyncio.gather(make_call(seed), _pause_bump_continue(address, version))
        if n == 1:
            return r
    raise AssertionError("the pause never caught the request running (3 seeds)")


def _versions_switch_once(vers, old, new):
    k = vers.index(new)
    assert 0 < k and vers[:k] == [old] * k and vers[k:] == [new] * (len(vers) - k)


def test_weight_update_mid_call_server_route(random_server):
    async def go():
        c = openai.AsyncOpenAI(base_url=f"http://{random_server.address}/v1", api_key="x", max_retries=0)
        name = (await c.models.list()).data[0].id
        return await _mid_call(lambda seed: c.chat.completions.create(
            messages=[{"role": "user", "content": "Go"}], model=name, max_tokens=300, temperature=1.0,
            seed=seed, extra_body={"return_token_ids": True}), random_server.address, 5)

    r = asyncio.run(go())
    ch = r.choices[0]
    vers, ids = ch.model_extra["token_versions"], ch.model_extra["token_ids"]
    _versions_switch_once(vers, 0, 5)
    # one response; not "stop" unless the model really stopped (the untrained model ran to the limit)
    assert ch.finish_reason == ("length" if len(ids) == 300 else "stop")
    assert len(ids) == 300 or ids[-1] == 2


def test_weight_update_mid_call_in_process_client(random_server, tok):
    from areal_cli.rollout.openai_client import ArealOpenAI

    async def go():
        client = ArealOpenAI(_engine(random_server), tok)
        r = await _mid_call(lambda seed: client.chat.completions.create(
            messages=[{"role": "user", "content": "Go"}], model="m", max_tokens=300, temperature=1.0,
            seed=seed + 1), random_server.address, 6)
        return client, r

    client, r = asyncio.run(go())
    it = client.cache.last
    _versions_switch_once(it.versions, 5, 6)
    assert r.choices[0].finish_reason == ("length" if len(it.output_ids) == 300 else "stop")
    assert r.choices[0].model_extra["token_versions"] == it.versions


# ------------------------------------------------------------------------- in-process client
def test_sdk_tool_episode_in_process(tool_server, tok):
    """Plain openai.AsyncOpenAI agent code, two turns with a tool call, exported as training rows."""
    from areal_cli.rollout.interaction_cache import rows_to_tensors
    from areal_cli.rollout.openai_client import ArealOpenAI

    async def agent(client: openai.AsyncOpenAI):
        msgs = question(3, 4)
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], temperature=0,
                                                 max_tokens=80)
        assert r.choices[0].finish_reason == "tool_calls"
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        for call in r.choices[0].message.tool_calls:
            msgs.append({"role": "tool", "tool_call_id": call.id,
                         "content": str(add(**json.loads(call.function.arguments)))})
        r2 = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], temperature=0,
                                                  max_tokens=30)
        return r, r2

    client = ArealOpenAI(_engine(tool_server), tok)
    assert isinstance(client, openai.AsyncOpenAI)
    r, r2 = asyncio.run(agent(client))
    from openai.types.chat import ChatCompletion

    assert isinstance(r, ChatCompletion) and isinstance(r2, ChatCompletion)
    first, second = list(client.cache)
    assert (second.parent_id, second.token_parent_id) == (first.id, first.id)
    real = first.input_ids + first.output_ids
    assert second.input_ids[:len(real)] == real
    for it in (first, second):  # the tokens are what the server generates for exactly these ids
        assert it.output_ids == _generate(tool_server, it.input_ids, len(it.output_ids))
    client.set_last_reward(1.0)
    d = rows_to_tensors(client.export_interactions("per_leaf"), tok.pad_token_id, 0).data
    assert d["input_ids"][0].tolist() == second.input_ids + second.output_ids
    mask = d["loss_mask"][0].tolist()
    n1, n2, p1 = len(first.output_ids), len(second.output_ids), len(first.input_ids)
    gap = len(second.input_ids) - p1 - n1
    assert mask == [0] * p1 + [1] * n1 + [0] * gap + [1] * n2
    assert d["logprobs"][0][d["loss_mask"][0]].tolist() == pytest.approx(first.logprobs + second.logprobs)
    assert d["rewards"].tolist() == [1.0]


def test_retokenization_drift_is_handled(random_server, tok):
    """The untrained model writes token sequences that decode and re-encode to other ids: the next
    call's prompt keeps the ids the model produced, and the drift is recorded."""
    from areal_cli.rollout.openai_client import ArealOpenAI

    async def go(client):
        msgs = [{"role": "user", "content": "Tell me"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=80, temperature=1.0,
                                                 seed=5)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More"}]
        await client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=1.0, seed=6)
        return msgs

    client = ArealOpenAI(_engine(random_server), tok)
    msgs = asyncio.run(go(client))
    first, second = list(client.cache)
    real = first.input_ids + first.output_ids
    fresh = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert second.retokenized and fresh != second.input_ids
    assert second.input_ids[:len(real)] == real  # the model's own ids, not a re-encoding of its text
    if first.stop_reason == "length":  # an unfinished turn is closed with the end-of-turn token (masked)
        assert second.input_ids[len(real)] == tok.eos_token_id
    row = client.export_interactions("per_leaf")[0]
    gen = [ids for ids, lp, _ in row["segments"] if lp is not None]
    assert gen == [first.output_ids, second.output_ids]
    # "template" mode re-renders instead: no token link, two separate rows
    t = ArealOpenAI(_engine(random_server), tok, prompt_mode="template")
    asyncio.run(go(t))
    assert list(t.cache)[1].input_ids == list(tok.apply_chat_template(
        list(t.cache)[1].messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert len(t.export_interactions("per_leaf")) == 2


# Qwen3 with enable_thinking=False: every generation header ends with an empty think block that the
# template drops when it re-renders the turn (and a render ending on an assistant turn adds one), so
# no render of the conversation is a prefix of the next.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
NEW_TEXT = ["\n<|im_start|>user\nUse the tool<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
            ("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
             "<think>\n\n</think>\n\n")]


async def _thinking_episode(client: openai.AsyncOpenAI) -> list:
    """Three calls of the untrained model, a user turn and a tool turn between them, each sent back verbatim."""
    msgs, out = question(3, 4), []
    for i, after in enumerate(([{"role": "user", "content": "Use the tool"}],
                               [{"role": "tool", "tool_call_id": "call_0", "content": "7"}], None)):
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=1.0,
                                                 seed=21 + i, extra_body=NO_THINK)
        out.append(r)
        if after:
            msgs = msgs + [r.choices[0].message.model_dump(exclude_none=True)] + after
    return out


def test_thinking_template_keeps_one_token_chain(random_server, tiny_model_dir):
    """Through Qwen3's template, which rewrites earlier turns, a three-call episode is one row: each
    prompt is the previous prompt, the ids the model sampled (closed with a masked EOS where it did not
    close the turn) and the template's text for only the new messages; the loss mask is 1 exactly on the
    sampled tokens, with their logprobs and versions. In-process and through the proxy alike;
    ``prompt_mode="template"`` keeps fresh renders and one row per call."""
    from areal_cli.rollout.interaction_cache import rows_to_tensors
    from areal_cli.rollout.openai_client import ArealOpenAI
    from areal_cli.rollout.proxy import AgentProxy, serve_proxy

    tok = qwen3_tokenizer(tiny_model_dir)
    eos = tok.eos_token_id

    def fresh(msgs):
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            **NO_THINK["chat_template_kwargs"])["input_ids"])

    def check_chain(calls, row):
        first = calls[0]
        assert first.input_ids == fresh(first.messages)
        want = list(first.input_ids)
        for prev, it, text in zip(calls, calls[1:], NEW_TEXT):
            assert it.token_parent_id == prev.id and it.rewritten_history
            want += prev.output_ids + ([eos] if prev.output_ids[-1] != eos else [])
            want += tok.encode(text, add_special_tokens=False)
            assert it.input_ids == want
            # a render of the messages differs inside the earlier turns (the dropped think block), not
            # only where the model's text re-encodes to other ids
            assert it.retokenized and it.render_diff_at < len(prev.input_ids)
            assert fresh(it.messages) != it.input_ids
        assert row["ids"] == [it.id for it in calls]
        d = rows_to_tensors([row], tok.pad_token_id, 0).data
        last = calls[-1]
        assert d["input_ids"][0].tolist() == last.input_ids + last.output_ids
        mask = d["loss_mask"][0].tolist()
        starts = [len(it.input_ids) for it in calls]
        want_mask = [0] * len(mask)
        for st, it in zip(starts, calls):
            want_mask[st:st + len(it.output_ids)] = [1] * len(it.output_ids)
        assert mask == [bool(m) for m in want_mask]
        on = d["loss_mask"][0]
        assert d["logprobs"][0][on].tolist() == pytest.approx([x for it in calls for x in it.logprobs])
        assert d["versions"][0][on].tolist() == [v for it in calls for v in it.versions]
        assert set(d["versions"][0][~on].tolist()) == {-1}

    client = ArealOpenAI(_engine(random_server), tok)
    replies = asyncio.run(_thinking_episode(client))
    calls = list(client.cache)
    rows = client.export_interactions("per_leaf")
    assert len(rows) == 1
    check_chain(calls, rows[0])
    assert [r.choices[0].model_extra["token_ids"] for r in replies] == [it.output_ids for it in calls]

    # the proxy runs the same code: one row with the same structure, through the real openai client
    p = serve_proxy(AgentProxy(_engine(random_server), tok, admin_key="admin-secret"))
    try:
        sid, key = _session(p)
        replies = asyncio.run(_thinking_episode(openai.AsyncOpenAI(base_url=p.base_url, api_key=key,
                                                                   max_retries=0)))
        assert httpx.post(f"http://{p.address}/rl/end_session",
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200
        prows = _admin(p, "/rl/export", session_id=sid, style="per_leaf").json()["rows"]
    finally:
        p.stop()
    assert len(prows) == 1 and prows[0]["ids"] == [r.id for r in replies]
    gen = [ids for ids, lp, _ in prows[0]["segments"] if lp is not None]
    assert gen == [r.choices[0].model_extra["token_ids"] for r in replies]
    gaps = [tok.decode(ids) for ids, lp, _ in prows[0]["segments"][1:] if lp is None]
    assert [g.removeprefix(tok.eos_token) for g in gaps] == NEW_TEXT

    # prompt_mode="template": today's fresh renders, message links only, one row per call
    t = ArealOpenAI(_engine(random_server), tok, prompt_mode="template")
    asyncio.run(_thinking_episode(t))
    tcalls = list(t.cache)
    assert all(it.input_ids == fresh(it.messages) and it.token_parent_id is None for it in tcalls)
    assert [it.parent_id for it in tcalls[1:]] == [it.id for it in tcalls[:-1]]
    assert len(t.export_interactions("per_leaf")) == 3


def test_openai_agents_sdk_in_process(tool_server, tok):
    agents = pytest.importorskip("agents")
    from areal_cli.rollout.openai_client import ArealOpenAI

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def add_tool(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    add_tool.name = "add"
    client = ArealOpenAI(_engine(tool_server), tok)
    agent = agents.Agent(name="calc", instructions=SYSTEM, tools=[add_tool],
                         model=agents.OpenAIChatCompletionsModel(model="policy", openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0.0, max_tokens=80))
    result = asyncio.run(agents.Runner.run(agent, "What is 3 plus 4?", max_turns=4))
    assert seen, "the agent never executed the tool"
    assert "The answer is" in str(result.final_output)
    calls = list(client.cache)
    assert len(calls) == 2 and calls[1].token_parent_id == calls[0].id, [c.messages for c in calls]
    assert calls[0].output_message["tool_calls"][0]["function"]["name"] == "add"
    for it in calls:
        assert it.output_ids == _generate(tool_server, it.input_ids, len(it.output_ids))
    row = client.export_interactions("per_leaf")[0]
    assert [ids for ids, lp, _ in row["segments"] if lp is not None] == [c.output_ids for c in calls]


# ------------------------------------------------------------------------------------------ proxy
@pytest.fixture()
def proxy(tool_server, tok):
    from areal_cli.rollout.proxy import AgentProxy, serve_proxy

    p = serve_proxy(AgentProxy(_engine(tool_server), tok, admin_key="admin-secret"))
    yield p
    p.stop()


def _admin(p, path, **body):
    return httpx.post(f"http://{p.address}{path}", json=body, timeout=60,
                      headers={"Authorization": "Bearer admin-secret"})


def _session(p, task="t"):
    assert _admin(p, "/rl/grant_capacity").status_code == 200
    s = _admin(p, "/rl/start_session", task_id=task).json()
    return s["session_id"], s["api_key"]


def _export_rows_match_server(tool_server, rows):
    for row in rows:
        segs = row["segments"]
        ids: list[int] = []
        for seg_ids, lp, _ in segs:
            if lp is not None:  # every trained segment is what the server generates after the ids before it
                assert seg_ids == _generate(tool_server, ids, len(seg_ids))
            ids += seg_ids


def test_proxy_keys_capacity_export_and_gc(proxy, tool_server):
    base = f"http://{proxy.address}"
    assert _admin(proxy, "/rl/start_session").status_code == 429  # no capacity granted
    sid, key = _session(proxy)
    other_sid, other_key = _session(proxy)
    hdr = {"Authorization": f"Bearer {key}"}
    chat = {"messages": question(1, 2), "max_tokens": 80, "temperature": 0}
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).status_code == 401
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, headers={"Authorization": "Bearer nope"},
                      timeout=60).status_code == 401
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60,
                      headers={"Authorization": "Bearer admin-secret"}).status_code == 403
    assert httpx.post(f"{base}/rl/export", json={"session_id": sid}, headers=hdr).status_code == 403
    assert httpx.post(f"{base}/rl/set_reward", json={"reward": 1.0}, headers=hdr).status_code == 400  # empty
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, headers=hdr, timeout=60)
    assert r.status_code == 200
    iid = r.json()["id"]
    # the other session's key cannot reach this session's interaction
    assert httpx.post(f"{base}/rl/set_reward", json={"interaction_id": iid, "reward": 1.0},
                      headers={"Authorization": f"Bearer {other_key}"}).status_code == 400
    assert httpx.post(f"{base}/rl/set_reward", json={"interaction_id": iid, "reward": 1.0},
                      headers=hdr).status_code == 200
    assert _admin(proxy, "/rl/export", session_id=sid).status_code == 409  # not ended yet
    assert httpx.post(f"{base}/rl/end_session", headers=hdr).json()["interaction_count"] == 1
    assert httpx.post(f"{base}/rl/end_session", headers=hdr).status_code == 410
    first = _admin(proxy, "/rl/export", session_id=sid, style="per_call", turn_discount=0.9)
    assert first.status_code == 200 and first.json()["rows"][0]["reward"] == 1.0
    _export_rows_match_server(tool_server, first.json()["rows"])
    assert _admin(proxy, "/rl/export", session_id=sid).status_code == 404  # once only
    # an idle session is collected
    proxy.proxy.session_timeout_s = 0.0
    assert other_sid in proxy.proxy.collect_idle()
    assert _admin(proxy, "/rl/export", session_id=other_sid).status_code == 404
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60,
                      headers={"Authorization": f"Bearer {other_key}"}).status_code == 401


def test_real_openai_client_through_proxy(proxy, tool_server):
    sid, key = _session(proxy, "sdk")

    async def agent():
        c = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        msgs = question(4, 5)
        r = await c.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL], max_tokens=80,
                                            temperature=0)
        call = r.choices[0].message.tool_calls[0]
        result = str(add(**json.loads(call.function.arguments)))
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
        stream = await c.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL],
                                                 max_tokens=30, temperature=0, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        return text

    assert asyncio.run(agent()).startswith("The answer is")
    hdr = {"Authorization": f"Bearer {key}"}
    httpx.post(f"http://{proxy.address}/rl/set_reward", json={"reward": 1.0}, headers=hdr)
    httpx.post(f"http://{proxy.address}/rl/end_session", headers=hdr)
    rows = _admin(proxy, "/rl/export", session_id=sid, style="per_leaf").json()["rows"]
    assert len(rows) == 1 and len(rows[0]["ids"]) == 2 and rows[0]["reward"] == 1.0
    assert rows[0]["tool_calls"] == 1
    _export_rows_match_server(tool_server, rows)


def test_langchain_through_proxy(proxy, tool_server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    sid, key = _session(proxy, "lc")
    llm = lc.ChatOpenAI(model="policy", base_url=proxy.base_url, api_key=key, temperature=0, max_tokens=80,
                        max_retries=0).bind_tools([add])

    async def agent():
        msgs = [SystemMessage(SYSTEM), HumanMessage("What is 6 plus 2?")]
        ai = await llm.ainvoke(msgs)
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "add"
        msgs.append(ai)
        for call in ai.tool_calls:
            msgs.append(ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"]))
        return await llm.ainvoke(msgs)

    final = asyncio.run(agent())
    assert final.content.startswith("The answer is")
    hdr = {"Authorization": f"Bearer {key}"}
    httpx.post(f"http://{proxy.address}/rl/set_reward", json={"reward": 0.5}, headers=hdr)
    httpx.post(f"http://{proxy.address}/rl/end_session", headers=hdr)
    rows = _admin(proxy, "/rl/export", session_id=sid, style="per_leaf").json()["rows"]
    assert len(rows) == 1 and len(rows[0]["ids"]) == 2  # LangChain's replayed history linked the two calls
    _export_rows_match_server(tool_server, rows)


# ------------------------------------------------------------------------------- agent workflow
async def _tool_agent(client, data):
    """The add-tool agent as ordinary SDK code; fails on purpose when data says so."""
    if data.get("fail") and not data.setdefault("_failed_once", False):
        data["_failed_once"] = True
        raise RuntimeError("the agent crashed")
    a, b = data["a"], data["b"]
    msgs = question(a, b)
    r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], max_tokens=80,
                                             temperature=0)
    m = r.choices[0].message
    if not m.tool_calls:
        return 0.0
    client.set_reward(r.id, 0.25)  # an intermediate reward for calling the tool
    msgs.append(m.model_dump(exclude_none=True))
    for call in m.tool_calls:
        try:
            out = str(add(**json.loads(call.function.arguments)))
        except (TypeError, ValueError):
            out = "error"
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": out})
    r2 = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], max_tokens=30,
                                              temperature=0)
    return 1.0 if str(a + b) in (r2.choices[0].message.content or "") else 0.0


def test_agent_workflow_rows_groups_and_failures(tool_server, tok):
    from areal_cli.algorithms.advantages import compute_advantages
    from areal_cli.rollout.workflows.agent import AgentWorkflow

    eng = _engine(tool_server)
    wf = AgentWorkflow(_tool_agent, tok, group_size=2, export_style="per_call", turn_discount=0.5)
    traj = asyncio.run(wf.arun_episode(eng, {"a": 3, "b": 4}))
    d = traj.data
    n = len(traj)
    assert n == 4 and len(set(d["group_id"].tolist())) == 1  # every call of both episodes: one group
    for row, lm in zip(d["input_ids"], d["loss_mask"]):  # masks only on generated tokens
        assert lm.sum() > 0 and not lm[:10].any()
    adv, _ = compute_advantages("grpo", rewards=d["rewards"], loss_mask=d["loss_mask"].float(), group_size=2,
                                group_ids=d["group_id"])
    assert adv.shape == d["loss_mask"].shape
    # one failing episode of the group: counted and dropped, the other one is kept
    wf2 = AgentWorkflow(_tool_agent, tok, group_size=2)
    traj2 = asyncio.run(wf2.arun_episode(eng, {"a": 1, "b": 2, "fail": True}))
    assert wf2.failed == 1 and len(traj2) == 1
    # per_leaf: one row of two turns; the tool call's 0.25 sits on its last token, the final reward on the row
    assert traj2.data["token_rewards"].sum().item() == pytest.approx(0.25)
    assert traj2.data["loss_mask"][0].float().diff().abs().sum().item() == 3  # two trained segments
    with pytest.raises(RuntimeError, match="crashed"):
        asyncio.run(AgentWorkflow(_tool_agent, tok, group_size=1, on_error="raise").arun_episode(
            eng, {"a": 1, "b": 2, "fail": True}))
    res = asyncio.run(wf.eval_episode(eng, {"a": 2, "b": 2}))  # evaluation runs the agent itself (greedy)
    assert res["tool_calls"] == 1 and res["success"] == (res["reward"] >= 1.0)
    assert d["agent_tool_calls"].tolist() == [1] * 4


def test_responses_api_in_process(tool_server, tok):
    """client.responses.create: a tool round trip in the Responses format, linked in the cache."""
    from openai.types.responses import Response

    from areal_cli.rollout.openai_client import ArealOpenAI

    tool = {"type": "function", "name": "add", "parameters": ADD_TOOL["function"]["parameters"]}

    async def agent(client):
        items = [{"role": "user", "content": "What is 3 plus 4?"}]
        r = await client.responses.create(model="m", instructions=SYSTEM, input=items, tools=[tool],
                                          temperature=0, max_output_tokens=80)
        calls = [o for o in r.output if o.type == "function_call"]
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"type": "function_call_output", "call_id": c.call_id,
                   "output": str(add(**json.loads(c.arguments)))} for c in calls]
        r2 = await client.responses.create(model="m", instructions=SYSTEM, input=items, tools=[tool],
                                           temperature=0, max_output_tokens=30)
        return r, r2

    client = ArealOpenAI(_engine(tool_server), tok)
    r, r2 = asyncio.run(agent(client))
    assert isinstance(r, Response) and [o.type for o in r.output] == ["function_call"]
    assert r2.output_text.startswith("The answer is")
    first, second = list(client.cache)
    assert (first.id, second.id) == (r.id, r2.id) and second.token_parent_id == first.id
    assert first.output_ids == _generate(tool_server, first.input_ids, len(first.output_ids))
    # the first prompt is the chat template of the same conversation in chat form
    want = tok.apply_chat_template(question(3, 4), tools=[ADD_TOOL], add_generation_prompt=True,
                                   tokenize=True)
    assert first.input_ids == list(want["input_ids"])


def test_proxy_workflow_runs_an_external_agent(tool_server, tok, monkeypatch):
    """ProxyAgentWorkflow: the agent is another process that only knows OPENAI_BASE_URL/OPENAI_API_KEY."""
    import os
    import sys

    from areal_cli.rollout.workflows.agent_proxy import ProxyAgentWorkflow

    here = str(SUPPORT)
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    wf = ProxyAgentWorkflow([sys.executable, os.path.join(here, "proxy_agent_script.py")], tok, group_size=2)
    try:
        traj = asyncio.run(wf.arun_episode(_engine(tool_server), {"id": "q1", "a": 3, "b": 4}))
        d = traj.data
        assert len(traj) == 2 and len(set(d["group_id"].tolist())) == 1  # one per_leaf row per episode
        assert d["rewards"].tolist()[0] in (0.5, 1.0)
        assert d["agent_tool_calls"].tolist() == [1, 1]  # the tool model calls add once per episode
        assert (d["loss_mask"].float().diff(dim=1).abs().sum(1) >= 3).all()  # two trained turns per row
        bad = ProxyAgentWorkflow([sys.executable, "-c", "import sys; sys.exit(3)"], tok, group_size=1)
        try:
            assert asyncio.run(bad.arun_episode(_engine(tool_server), {"id": "q2"})) is None
            assert bad.failed == 1
        finally:
            bad.close()
    finally:
        wf.close()


async def _lc_add_agent(base_url, api_key, data):
    """The add-tool agent in LangChain, in process but over HTTP through the proxy (the proxy workflow's
    ``agent`` contract): reward 1 for an answer after the tool's result, 0.5 for a call only."""
    from langchain_openai import ChatOpenAI

    async with httpx.AsyncClient(timeout=120) as http:  # LangChain's shared one is bound to its first loop
        llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, temperature=data.get("temperature", 0),
                         max_tokens=80, max_retries=0, http_async_client=http).bind_tools([ADD_TOOL])
        return await _lc_add_loop(llm, data)


async def _lc_add_loop(llm, data):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    msgs = [SystemMessage(SYSTEM), HumanMessage(f"What is {data['a']} plus {data['b']}?")]
    ai = await llm.ainvoke(msgs)
    if not ai.tool_calls:
        return 0.0
    msgs.append(ai)
    for call in ai.tool_calls:
        msgs.append(ToolMessage(str(add(**call["args"])), tool_call_id=call["id"]))
    final = await llm.ainvoke(msgs)
    return 1.0 if str(final.content).startswith("The answer is") else 0.5


def test_proxy_workflow_runs_an_in_process_agent_and_evaluates_it(proxy, tool_server, tok):
    """``agent=`` instead of a command: no process per episode, the same proxy sessions; evaluation runs
    the agent in a greedy session whatever temperature it asks for, and trains nothing."""
    import os
    import sys

    pytest.importorskip("langchain_openai")
    from areal_cli.errors import ConfigError
    from areal_cli.rollout.workflows.agent_proxy import ProxyAgentWorkflow

    # a greedy session decodes greedily although the call asks for temperature 1.0
    assert _admin(proxy, "/rl/grant_capacity").status_code == 200
    assert _admin(proxy, "/rl/start_session", greedy="yes").status_code == 400
    s = _admin(proxy, "/rl/start_session", greedy=True).json()
    msgs = question(5, 3)
    sampled = httpx.post(f"{proxy.base_url}/chat/completions", timeout=60, headers={
        "Authorization": f"Bearer {s['api_key']}"}, json={"model": "p", "messages": msgs, "tools": [ADD_TOOL],
                                                          "max_tokens": 40, "temperature": 1.0}).json()
    ids = sampled["choices"][0]["token_ids"]
    assert ids == _generate(tool_server, sampled["prompt_token_ids"], len(ids))

    with pytest.raises(ConfigError, match="either"):
        ProxyAgentWorkflow("python a.py", tok, agent=_lc_add_agent)
    wf = ProxyAgentWorkflow(tokenizer=tok, group_size=2, agent=_lc_add_agent)
    try:
        traj = asyncio.run(wf.arun_episode(_engine(tool_server), {"id": "q1", "a": 3, "b": 4}))
        assert wf.failed == 0 and len(traj) == 2 and len(set(traj.data["group_id"].tolist())) == 1
        assert traj.data["agent_tool_calls"].tolist() == [1, 1]  # the tool model calls add once
        assert (traj.data["loss_mask"].float().diff(dim=1).abs().sum(1) >= 3).all()  # two trained turns
        res = asyncio.run(wf.eval_episode(_engine(tool_server), {"id": "e1", "a": 3, "b": 4, "temperature": 1.0}))
        assert res == {"success": True, "reward": 1.0, "tool_calls": 1}
        assert not wf.server.proxy._sessions  # the evaluation's session was taken, not left to export
    finally:
        wf.close()

    async def broken(base_url, api_key, data):
        raise RuntimeError("the agent crashed")

    bad = ProxyAgentWorkflow(tokenizer=tok, agent=broken)
    try:  # an evaluation episode that fails counts as unsolved, and is counted
        assert asyncio.run(bad.eval_episode(_engine(tool_server), {"id": "e3"})) == {
            "success": False, "reward": 0.0, "tool_calls": 0}
        assert bad.failed == 1
        bad.on_error = "raise"
        with pytest.raises(RuntimeError, match="crashed"):
            asyncio.run(bad.eval_episode(_engine(tool_server), {"id": "e4"}))
    finally:
        bad.close()
    # a command is evaluated the same way, from the reward it posted
    here = str(SUPPORT)
    env_path = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"], old = env_path, os.environ.get("PYTHONPATH")
    cmd = ProxyAgentWorkflow([sys.executable, os.path.join(here, "proxy_agent_script.py")], tok,
                             success_threshold=0.75)
    try:
        res = asyncio.run(cmd.eval_episode(_engine(tool_server), {"id": "e2", "a": 3, "b": 4}))
        assert res["tool_calls"] == 1 and res["reward"] in (0.5, 1.0), res
        assert res["success"] == (res["reward"] >= 0.75)
    finally:
        cmd.close()
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def _calculator_item() -> dict:
    """A built-in ``arith_easy`` item whose warm-start example offers the tool (``sft_mix=(4, 1, 3)``)."""
    import zlib

    from areal_cli.data.builtin import generate_split

    for row in generate_split("arith_easy", "train", 64):
        if zlib.crc32(row["question"].encode()) % 8 >= 4:
            return {"id": row["id"], "question": row["question"], "answer": row["ground_truth"],
                    "solution": row["answer"]}
    raise AssertionError("no item with the tool offered")


def test_framework_calculators_prompt_as_their_warm_start(proxy, tool_server, tok):
    """experiment=agent_calculator_agents_sdk / _langchain: the first call each framework sends is, token for
    token, the prompt its warm start trains on (the tool in the framework's own schema)."""
    pytest.importorskip("agents")
    pytest.importorskip("langchain_openai")
    from areal_cli.rollout.openai_client import ArealOpenAI
    from areal_cli.rollout.workflows.calculator_frameworks import langchain_shaped_agent, sdk_shaped_agent

    item = _calculator_item()
    client = ArealOpenAI(_engine(tool_server), tok)
    asyncio.run(sdk_shaped_agent(client, item))
    sdk_prompt = list(client.cache)[0].input_ids
    assert sdk_prompt == sdk_shaped_agent.sft_example(item, tok)["prompt_ids"]
    sid, key = _session(proxy, "calc")
    asyncio.run(langchain_shaped_agent(proxy.base_url, key, item))
    lc_prompt = list(proxy.proxy.take(sid).cache)[0].input_ids
    assert lc_prompt == langchain_shaped_agent.sft_example(item, tok)["prompt_ids"]
    assert lc_prompt != sdk_prompt  # the two frameworks send the tool in different schemas


def test_servers_keep_idle_connections_past_client_keepalives(proxy, tool_server):
    """The hf server and the proxy keep an idle connection open longer than the clients in front of them
    keep theirs (httpx 5 s, ours 3 s): a request on a kept-alive connection never meets a server that is
    closing it (uvicorn's default of 5 s raced httpx's and dropped agent episodes with read errors)."""
    import http.client
    import time

    from areal_cli.inference.client import KEEPALIVE_S

    conns = {name: http.client.HTTPConnection(*addr.split(":"), timeout=30)
             for name, addr in (("hf", tool_server.address), ("proxy", proxy.address))}
    paths = {"hf": "/health", "proxy": "/v1/models"}
    for name, c in conns.items():
        c.request("GET", paths[name])
        c.getresponse().read()
    time.sleep(max(6.0, KEEPALIVE_S + 1))  # past uvicorn's default keep-alive
    for name, c in conns.items():
        c.request("GET", paths[name])  # the same socket: had the server closed it, no response comes back
        r = c.getresponse()
        r.read()
        assert r.status in (200, 401), (name, r.status)  # the proxy answers 401 without a session key
        c.close()
