"""Helpers for the agent tests: a tiny model taught the Hermes tool-call format, and its tool."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
from pathlib import Path

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


def _tool_model_key(base_dir: str, steps: int, seed: int) -> str:
    """A content hash of everything the fine-tuned model depends on: the base model's files, the
    training code and data below, the step count, the seed and the torch version."""
    import torch

    h = hashlib.sha256()
    for f in sorted(Path(base_dir).iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for fn in (question, transcript, _train_tool_model):
        h.update(inspect.getsource(fn).encode())
    h.update(json.dumps([TOOL_SHAPES, SYSTEM, steps, seed, torch.__version__], sort_keys=True).encode())
    return h.hexdigest()[:16]


def make_tool_model(base_dir: str, out_dir: str, steps: int = 100, seed: int = 0) -> str:
    """The tool-calling tiny model (:func:`_train_tool_model`), cached under
    ``$AREAL_TEST_CACHE`` (default ``~/.cache/areal/test-tool-models/<content hash>``): the
    fine-tune runs once per distinct base model / recipe, later sessions copy the result into
    ``out_dir``. ``AREAL_TEST_CACHE=off`` always trains."""
    return cached_model(_tool_model_key(base_dir, steps, seed), out_dir,
                        lambda d: _train_tool_model(base_dir, d, steps, seed))


def cached_model(key: str, out_dir: str, train) -> str:
    """``train(dir)``'s model in ``out_dir``, built once per ``key`` under ``$AREAL_TEST_CACHE`` (default
    ``~/.cache/areal/test-tool-models``) and copied from there later; ``AREAL_TEST_CACHE=off`` always trains."""
    root = os.environ.get("AREAL_TEST_CACHE", "~/.cache/areal/test-tool-models")
    if root == "off":
        train(out_dir)
        return out_dir
    cached = Path(os.path.expanduser(root)) / key
    if not (cached / "READY").exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.parent / f".{cached.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        train(str(tmp))
        (tmp / "READY").write_text("1")
        try:
            os.replace(tmp, cached)  # atomic; a concurrent builder that lost the race keeps its copy
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("READY"))
    return out_dir


def finetune_tiny(base_dir: str, out_dir: str, steps: int, seed: int, batch) -> str:
    """Fine-tune the tiny model at ``base_dir`` for ``steps`` Adam steps on ``batch(tok, rng)`` (sequences, and
    per sequence how many leading tokens take no loss, or None) and save it with its tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        seqs, starts = batch(tok, rng)
        n = max(len(s) for s in seqs)
        ids = torch.tensor([s + [tok.pad_token_id] * (n - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        labels = ids.masked_fill(mask == 0, -100)
        for i, k in enumerate(starts or []):
            labels[i, :k] = -100
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def _train_tool_model(base_dir: str, out_dir: str, steps: int = 100, seed: int = 0) -> str:
    """Fine-tune ``base_dir`` (a tiny model) on add-tool transcripts so that, greedily, it answers a
    question with a ``<tool_call>`` and a tool result with a final answer: a real model whose real
    outputs exercise the tool round trip (the numbers it writes need not be right)."""
    def batch(tok, rng):
        return [list(tok.apply_chat_template(transcript(rng.randint(0, 9), rng.randint(0, 9)),
                                             tools=[rng.choice(TOOL_SHAPES)], tokenize=True)["input_ids"])
                for _ in range(8)], None

    return finetune_tiny(base_dir, out_dir, steps, seed, batch)


# Qwen3's chat template (Qwen/Qwen3-*'s tokenizer_config.json, reasoning and tool parts as published),
# for the tests of thinking templates. It rewrites history: an assistant turn before the last user query
# loses its ``<think>…</think>`` block, the last assistant message of a render gets an (empty) think
# block that the same turn loses once more messages follow, and with ``enable_thinking=False`` the
# generation header ends with an empty think block that the re-rendered turn no longer has.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def qwen3_tokenizer(model_dir: str):
    """The tiny model's tokenizer with :data:`QWEN3_TEMPLATE` as its chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = QWEN3_TEMPLATE
    return tok
