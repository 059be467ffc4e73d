"""``prompt_mode="continue"`` through Qwen3's template when the model really thinks: the template drops
``<think>…</think>`` from assistant turns before the last user query, yet the episode stays one token
chain carrying the sampled ids. The model's output is scripted (a thinking model's turns, tokenized one
character at a time, as a sampler may produce them and as no re-encoding of the text would); the prompt
construction, the real tokenizer and the template are the things under test."""

from __future__ import annotations

import asyncio

from agent_helpers import ADD_TOOL, question, qwen3_tokenizer
from rollout_fakes import FakeEngine

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
TURNS = ["<think>\nI should add.\n</think>\n\n" + CALL, "<think>\nIt is 7.\n</think>\n\nThe answer is 7.",
         "<think>\nDouble.\n</think>\n\n14"]


def _run(tok, prompt_mode: str):
    from areal_cli.rollout.openai_client import ArealOpenAI

    eos = tok.eos_token_id
    engine = FakeEngine(token_delay=0, eos_token_id=eos)
    # one id per character: the ids a sampler may pick for this text, never what encoding it gives
    engine.scripted = [[i for ch in t for i in tok.encode(ch, add_special_tokens=False)] + [eos] for t in TURNS]
    client = ArealOpenAI(engine, tok, prompt_mode=prompt_mode)

    async def agent():
        msgs = question(3, 4)
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL])
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL])
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Now double it."}]
        await client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL])

    asyncio.run(agent())
    return client


def test_stripped_thinking_stays_one_chain(tiny_model_dir):
    tok = qwen3_tokenizer(tiny_model_dir)
    client = _run(tok, "continue")
    first, second, third = calls = list(client.cache)

    def fresh(it):
        return tok.apply_chat_template(it.messages, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=False)

    # the template renders the third call's history without the first two turns' thinking ...
    assert "I should add." not in fresh(third) and "It is 7." not in fresh(third)
    # ... its prompt keeps every id the model sampled, followed by the template's text for the new turn
    assert third.token_parent_id == second.id and second.token_parent_id == first.id
    assert third.input_ids == (first.input_ids + first.output_ids
                               + tok.encode("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                                            "<|im_start|>assistant\n", add_special_tokens=False)
                               + second.output_ids
                               + tok.encode("\n<|im_start|>user\nNow double it.<|im_end|>\n<|im_start|>assistant\n",
                                            add_special_tokens=False))
    assert third.rewritten_history and third.retokenized
    assert len(first.input_ids) <= third.render_diff_at < len(first.input_ids) + len(first.output_ids)
    # one row: the sampled ids are the trained ones (mask 1), the template's text is not
    (row,) = client.export_interactions("per_leaf")
    assert row["ids"] == [it.id for it in calls]
    assert [ids for ids, lp, _ in row["segments"] if lp is not None] == [it.output_ids for it in calls]
    # prompt_mode="template": fresh renders, one row per call
    t = _run(tok, "template")
    assert all(it.token_parent_id is None and it.input_ids == tok.encode(fresh(it), add_special_tokens=False)
               for it in t.cache)
    assert len(t.export_interactions("per_leaf")) == 3
