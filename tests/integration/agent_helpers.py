"""Helpers for the agent tests: a tiny model taught the Hermes tool-call format, and its tool."""

from __future__ import annotations

import json
import random

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                   "b": {"type": "integer"}}}}}
# The same tool as the OpenAI Agents SDK (@function_tool) and LangChain (@tool) describe it: the model
# is trained on all three so that every framework's request looks familiar to it.
AGENTS_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"properties": {"a": {"title": "A", "type": "integer"},
                                  "b": {"title": "B", "type": "integer"}},
                   "required": ["a", "b"], "title": "add_tool_args", "type": "object",
                   "additionalProperties": False}, "strict": True}}
LANGCHAIN_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
                   "type": "object"}}}
TOOL_SHAPES = [ADD_TOOL, AGENTS_TOOL, LANGCHAIN_TOOL]
SYSTEM = "Use the add tool."


def question(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} plus {b}?"}]


def transcript(a: int, b: int) -> list[dict]:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return question(a, b) + [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)},
                             {"role": "assistant", "content": f"The answer is {a + b}."}]


def make_tool_model(base_dir: str, out_dir: str, steps: int = 100, seed: int = 0) -> str:
    """Fine-tune ``base_dir`` (a tiny model) on add-tool transcripts so that, greedily, it answers a
    question with a ``<tool_call>`` and a tool result with a final answer: a real model whose real
    outputs exercise the tool round trip (the numbers it writes need not be right)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        seqs = [list(tok.apply_chat_template(transcript(rng.randint(0, 9), rng.randint(0, 9)),
                                             tools=[rng.choice(TOOL_SHAPES)], tokenize=True)["input_ids"])
                for _ in range(8)]
        n = max(len(s) for s in seqs)
        ids = torch.tensor([s + [tok.pad_token_id] * (n - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
