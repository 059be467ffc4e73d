"""``client.responses.create`` for the in-process client: the Responses API on the same path.

The request is turned into chat messages, then generated, recorded and parsed exactly like
``chat.completions.create``:
- ``instructions`` becomes a system message; a string ``input`` one user message;
- message items (``input_text``/``output_text`` parts) become chat messages;
- ``function_call`` items become an assistant turn's ``tool_calls`` (merged into the assistant
  message just before them);
- ``function_call_output`` items become ``tool`` messages.

The reply is a genuine ``openai.types.responses.Response``. Its ``output`` holds the text as one
``message`` item (when there is text) and one ``function_call`` item per tool call; a call's
``call_id`` is the tool-call id the cache records, so replaying the output as the next input links
the next call to this one. The interaction's id is the response id. Streaming
(``stream=True``), ``include`` and ``top_logprobs`` are refused; errors are the SDK's exceptions
(``openai.BadRequestError``, ...) as for chat completions.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from areal_cli.inference.server.openai_compat import (
    normalise_messages,
    parse_tools,
    plain,
    refuse_unsupported,
)
from areal_cli.rollout.openai_errors import sdk_error


def _given(v: Any) -> bool:
    import openai

    return v is not None and not isinstance(v, (openai.NotGiven, openai.Omit))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content or []:
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            raise ValueError("responses.create: only text content parts are supported")
        parts.append(p.get("text", ""))
    return "".join(parts)


def input_to_messages(input: Any, instructions: Any) -> list[dict]:
    msgs: list[dict] = []
    if _given(instructions):
        msgs.append({"role": "system", "content": str(instructions)})
    if isinstance(input, str):
        return msgs + [{"role": "user", "content": input}]
    if not isinstance(input, (list, tuple)):
        raise ValueError("responses.create: input must be a string or a list of input items")
    for i, item in enumerate(plain(list(input))):
        try:
            _add_item(msgs, item)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"responses.create: input[{i}] is malformed ({type(e).__name__}: {e})") from None
    return msgs


def _add_item(msgs: list[dict], item: dict) -> None:
    """One Responses input item appended to ``msgs`` as chat messages (module docstring)."""
    kind = item.get("type", "message")
    if kind == "message":
        msgs.append({"role": item["role"], "content": _text(item.get("content"))})
    elif kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
        last = msgs[-1] if msgs else None
        if last is not None and last["role"] == "assistant":  # the text and the calls of one response
            last.setdefault("tool_calls", []).append(call)
            if not last.get("content"):
                last["content"] = None
        else:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out = item.get("output")
        msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                     "content": out if isinstance(out, str) else _text(out)})
    else:
        raise ValueError(f"responses.create: input items of type {kind!r} are not supported")


def _chat_tools(tools: Any) -> list[dict] | None:
    if not _given(tools):
        return None
    out = []
    for t in plain(list(tools)):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ValueError("responses.create: only function tools ({type: 'function', name, parameters}) "
                             f"are supported, got {t!r}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


class Responses:
    def __init__(self, client: Any):
        self._c = client

    async def create(self, *, input: Any = None, model: Any = None, instructions: Any = None, tools: Any = None,
                     tool_choice: Any = None, max_output_tokens: Any = None, temperature: Any = None,
                     top_p: Any = None, stream: Any = None, include: Any = None, store: Any = None,
                     parallel_tool_calls: Any = None, extra_body: Any = None, **kwargs: Any) -> Any:
        args = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        try:
            return await self._create(**args, **kwargs)
        except Exception as e:  # as the SDK raises a server's answer: openai.BadRequestError for a 400, ...
            err = sdk_error(self._c, e, "/responses")
            if err is None or err is e:
                raise
            raise err from e

    async def _create(self, *, input: Any, model: Any, instructions: Any, tools: Any, tool_choice: Any,
                      max_output_tokens: Any, temperature: Any, top_p: Any, stream: Any, include: Any,
                      store: Any, parallel_tool_calls: Any, extra_body: Any, **kwargs: Any) -> Any:
        from openai.types.responses import Response

        if _given(stream) and stream:
            raise ValueError("responses.create(stream=True) is not supported by the in-process client")
        if _given(include) and include:
            raise ValueError("responses.create(include=...) is not supported by the in-process client")
        refuse_unsupported({k: v for k, v in kwargs.items() if _given(v)})
        chat_tools = _chat_tools(tools)
        choice = plain(tool_choice) if _given(tool_choice) else None
        tools_l, choice, parse = parse_tools({"tools": chat_tools, "tool_choice": choice})
        msgs = normalise_messages(input_to_messages(input, instructions))
        rid = f"resp_{uuid.uuid4().hex}"
        comp = await self._c._complete(
            msgs, tools_l, choice, parse, max_output_tokens if _given(max_output_tokens) else None,
            temperature if _given(temperature) else None, top_p if _given(top_p) else None, [], None,
            dict(extra_body) if _given(extra_body) else {}, parallel_tool_calls is not False,
            store is not False, interaction_id=rid)
        m = comp.choices[0].message
        output: list[dict] = []
        if m.content:
            output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                           "status": "completed",
                           "content": [{"type": "output_text", "text": m.content, "annotations": []}]})
        for call in m.tool_calls or []:
            output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call.id,
                           "name": call.function.name, "arguments": call.function.arguments,
                           "status": "completed"})
        u = comp.usage
        cut = comp.choices[0].finish_reason == "length"
        funcs = [t["function"] for t in (tools_l or [])]
        resp = Response.model_validate({
            "id": rid, "object": "response", "created_at": time.time(), "model": self._c.model_name,
            "output": output, "parallel_tool_calls": parallel_tool_calls is not False,
            "tool_choice": choice or "auto",
            "tools": [{"type": "function", "name": f["name"], "parameters": f.get("parameters") or {},
                       "strict": False, **({"description": f["description"]} if "description" in f else {})}
                      for f in funcs],
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                      "total_tokens": u.total_tokens,
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}})
        if store is not False:
            self._c.cache[rid].response = resp
        return resp
