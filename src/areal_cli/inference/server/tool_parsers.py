"""Tool-call parsers: a model's raw completion text -> OpenAI ``message.tool_calls``.

Two families, selected by name (``PARSERS``) or from the model's ``config.json`` ``model_type``
(:func:`parser_for_model_type`):

- ``hermes`` (aliases ``qwen``, ``qwen25``, ``qwen3``):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number, anywhere in the text (Hermes-2-Pro, Qwen2.5, Qwen3). The text outside the
  blocks is the message content.
- ``llama3_json`` (alias ``llama3``): the whole completion is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``, optionally after ``<|python_tag|>``
  (Llama-3.1/3.2's JSON tool calling). A completion that does not start with ``{`` is plain content.

Common rules, the ones users trip over elsewhere:
- text inside ``<think>...</think>`` is reasoning and is never parsed (a call the model only *thought
  about* is not executed); an unterminated ``<think>`` makes the whole text reasoning;
- a parse failure (bad JSON, an unterminated block, a call without a name) never raises: the result
  carries the raw text as content, no calls, and ``error`` saying why;
- arguments travel as a JSON string, as in OpenAI's API.

No torch, no transformers: the in-process client (``rollout/openai_client.py``) uses the same code.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ParsedCompletion:
    content: str | None  # None only when the completion was nothing but tool calls
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI wire shape
    error: str | None = None  # why parsing failed (then content is the raw text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: Any, args: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call without a string 'name': {name!r}")
    if isinstance(args, str):  # already a JSON string: keep it, but it must be JSON
        json.loads(args)
        arg_str = args
    elif args is None or isinstance(args, dict):
        arg_str = json.dumps(args or {}, ensure_ascii=False)
    else:
        raise ValueError(f"tool call arguments must be an object, got {type(args).__name__}")
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arg_str}}


def split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, answer)``: reasoning is everything up to and including the last ``</think>``;
    an opened but unterminated ``<think>`` makes the whole text reasoning."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        cut = close + len(THINK_CLOSE)
        return text[:cut], text[cut:]
    if THINK_OPEN in text:
        return text, ""
    return "", text


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(answer: str) -> tuple[str, list[dict[str, Any]]]:
    calls = []
    for m in _HERMES_BLOCK.finditer(answer):
        obj = json.loads(m.group(1).strip())
        if not isinstance(obj, dict):
            raise ValueError(f"<tool_call> holds {type(obj).__name__}, not an object")
        calls.append(_call(obj.get("name"), obj.get("arguments", obj.get("parameters"))))
    rest = _HERMES_BLOCK.sub("", answer)
    if "<tool_call>" in rest or "</tool_call>" in rest:
        raise ValueError("unterminated or unopened <tool_call> block")
    return rest.strip(), calls


def parse_llama3_json(answer: str) -> tuple[str, list[dict[str, Any]]]:
    text = answer.strip()
    if text.startswith("<|python_tag|>"):
        text = text[len("<|python_tag|>"):].lstrip()
    elif not text.startswith("{"):
        return answer, []
    dec = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(text):
        obj, end = dec.raw_decode(text, pos)
        if not isinstance(obj, dict):
            raise ValueError(f"a Llama-3 tool call must be a JSON object, got {type(obj).__name__}")
        calls.append(_call(obj.get("name"), obj.get("parameters", obj.get("arguments"))))
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return "", calls


PARSERS: dict[str, Callable[[str], tuple[str, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes, "qwen": parse_hermes, "qwen25": parse_hermes, "qwen3": parse_hermes,
    "llama3_json": parse_llama3_json, "llama3": parse_llama3_json,
}
# model_type (config.json) -> parser: Qwen and Hermes-style models use <tool_call> blocks.
_BY_MODEL_TYPE = {"llama": "llama3_json", "mllama": "llama3_json"}


def parser_for_model_type(model_type: str | None) -> str:
    return _BY_MODEL_TYPE.get((model_type or "").lower(), "hermes")


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {sorted(PARSERS)}")
    return name


def parse_tool_calls(text: str, parser: str) -> ParsedCompletion:
    """Parse ``text`` with the named parser (see the module docstring for the rules)."""
    fn = PARSERS[check_parser(parser)]
    reasoning, answer = split_reasoning(text)
    try:
        rest, calls = fn(answer)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        return ParsedCompletion(content=text, error=f"{type(e).__name__}: {e}")
    if not calls:
        return ParsedCompletion(content=text)
    content = (reasoning + rest).strip()
    return ParsedCompletion(content=content or None, tool_calls=calls)
