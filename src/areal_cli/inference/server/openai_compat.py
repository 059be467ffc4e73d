"""The ``hf`` server's OpenAI chat completions, made safe for RL.

What a training loop needs from ``/v1/chat/completions`` and plain OpenAI servers do not give:

- nothing is silently ignored: ``seed`` is honoured (one sampling seed per choice: ``seed + i``);
  penalties, ``logit_bias``, structured ``response_format`` and forced ``tool_choice`` are refused
  with a 400 (the server cannot honour them); ``n=0`` is a 400 and an unknown ``model`` a 404;
- ``tools`` and ``tool_choice`` go into the chat template; the standard tool round trip (an assistant
  turn with ``content: null`` + ``tool_calls``, then ``tool`` turns) is accepted; the completion is
  parsed for tool calls (:mod:`.tool_parsers`, chosen from the model family or the request's
  ``tool_call_parser``) and ``finish_reason`` becomes ``"tool_calls"``;
- a generation cut by a weight-update pause is resumed here (prompt + tokens so far, once the
  server continues), so the caller gets one response whose per-token versions change mid-sequence,
  and its ``finish_reason`` is ``stop``/``tool_calls`` only when generation really stopped;
- ``return_token_ids: true`` (an extension, vLLM's name) adds ``prompt_token_ids`` to the response
  and ``token_ids``, ``token_logprobs``, ``token_versions`` to each choice;
- ``stream: true`` answers as server-sent events (the whole completion is generated first, then sent
  as role, content, one chunk per tool call and a final chunk; ``stream_options.include_usage``
  adds the usage chunk).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from areal_cli.inference.server import tool_parsers as TP
from areal_cli.inference.server.schema import BadRequest, openai_sampling

PAUSE_ABORT = "generation paused for a weight update"  # engine.py's pause message
ROLES = ("system", "developer", "user", "assistant", "tool")


def plain(obj: Any) -> Any:
    """SDK pydantic objects / TypedDicts -> plain JSON-like data (what the functions here take).

    The rollout side's OpenAI-shaped client and its Responses API both use it, so it lives here, below
    both, rather than in one of them (they would import each other)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


class HTTPError(Exception):
    """Rendered by the app as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def check_model(state: Any, body: dict) -> None:
    """404 for a model name the server does not serve (absent: the served model)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {type(model).__name__}")
    known = {state.served_model_name, state.model_path, *getattr(state, "extra_model_names", ())}
    if model not in known:
        raise HTTPError(404, f"The model {model!r} does not exist; this server serves "
                             f"{state.served_model_name!r} (GET /v1/models)")


MAX_SEQS_PER_REQUEST = 1024  # app.py's bound on sequences per request


def parse_n(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SEQS_PER_REQUEST:
        raise BadRequest(f"n must be an integer in [1, {MAX_SEQS_PER_REQUEST}], got {n!r}")
    return n


def _text_content(content: Any, where: str, images: list | None = None) -> str | list[dict]:
    """The content as the chat template takes it: a string, or (when it has images) a list of text and
    ``{"type": "image"}`` parts, each image's reference appended to ``images`` (None: a text-only model)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict] = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("image_url", "input_image", "image"):
                if images is None:
                    raise BadRequest(f"{where}.content[{j}]: image content was sent but this model is "
                                     "text-only")
                ref = p.get("image_url", p.get("image"))
                if ref is None:
                    raise BadRequest(f"{where}.content[{j}]: an {kind} part needs image_url.url")
                images.append(ref)
                parts.append({"type": "image"})
                continue
            if kind not in ("text", "input_text", "output_text") or not isinstance(p.get("text"), str):
                raise BadRequest(f"{where}: only text and image_url content parts are supported")
            parts.append({"type": "text", "text": p["text"]})
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts")


def _tool_call_for_template(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequest(f"{where}: each tool call needs function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:  # chat templates render arguments as an object (HF's convention)
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # kept as the string the model wrote
    elif not isinstance(args, dict):
        raise BadRequest(f"{where}: function.arguments must be a JSON string or an object")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalise_messages(msgs: Any, images: list | None = None) -> list[dict]:
    """OpenAI chat messages -> the dicts chat templates take (400 on anything malformed); image parts'
    references are appended to ``images`` in prompt order (None: the model takes no images)."""
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list of message objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object with role in {list(ROLES)}")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise BadRequest(f"{where}.tool_calls must be a list")
            msg["tool_calls"] = [_tool_call_for_template(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(calls)]
            msg["content"] = None if m.get("content") is None else _text_content(m["content"], where)
        else:
            if m.get("content") is None:
                raise BadRequest(f"{where}: content is required (null only on an assistant turn with "
                                 "tool_calls)")
            msg["content"] = _text_content(m["content"], where, images)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadRequest(f"{where}: a tool message needs tool_call_id (the id of the call it "
                                 "answers)")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_tools(body: dict) -> tuple[list[dict] | None, Any, bool]:
    """``(tools, tool_choice, parse)``; ``parse`` is whether the completion is parsed for calls."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function"
                and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
                for t in tools):
            raise BadRequest("tools must be a list of {type: 'function', function: {name, parameters}}")
        tools = tools or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice={choice!r} is not supported: the hf server has no constrained "
                         "decoding "
                         "to force a call; use 'auto' or 'none'")
    return tools, choice, tools is not None and choice != "none"


def refuse_unsupported(body: dict) -> None:
    """400 for fields that would change sampling and that this server cannot honour."""
    for k in ("frequency_penalty", "presence_penalty"):
        v = body.get(k)
        if v is not None and v != 0:
            raise BadRequest(f"{k}={v!r} is not supported by the hf server (only 0); it is refused rather "
                             "than ignored so that sampling is what the trainer assumes")
    rp = body.get("repetition_penalty")
    if rp is not None and rp != 1:
        raise BadRequest(f"repetition_penalty={rp!r} is not supported by the hf server (only 1)")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported by the hf server")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise BadRequest("response_format other than {'type': 'text'} is not supported "
                         "(no constrained decoding)")
    if body.get("top_logprobs"):
        raise BadRequest(f"top_logprobs={body['top_logprobs']!r} is not supported: this inference path returns "
                         "only the sampled token's logprob (logprobs: true gives it for every token, with "
                         "top_logprobs: []); leave top_logprobs out or 0")
    for k in ("audio", "prediction", "web_search_options"):
        if body.get(k) is not None:
            raise BadRequest(f"{k} is not supported by the hf server")


def render_prompt(state: Any, msgs: list[dict], tools: list[dict] | None, tool_choice: Any,
                  body: dict) -> list[int]:
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    if tools is not None:
        kw = {**kw, "tool_choice": tool_choice}
    try:
        enc = state.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                                  tokenize=True, **kw)
    except Exception as e:  # jinja errors from a template that cannot render these messages
        raise BadRequest(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    if tools is not None:
        plain = state.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        if list(plain["input_ids"] if hasattr(plain, "keys") else plain) == ids:
            raise BadRequest("this model's chat template does not render tools (the prompt is the same "
                             "with and without them); the tools would be silently dropped")
    return ids


async def generate_resumable(run: Callable[..., Awaitable[Any]], ids: list[int], sp: Any,
                             request: Any, images: Any = None) -> Any:
    """Generate; a weight-update pause aborts the request, which is resubmitted as prompt + tokens so
    far with the remaining budget (held by the engine until generation continues). Returns one
    Sequence whose ``out_versions`` span the versions that produced its tokens."""
    from areal_cli.inference.server.engine import Sequence

    toks: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    while True:
        left = sp.max_new_tokens - len(toks)
        part = dataclasses.replace(sp, max_new_tokens=left,
                                   min_new_tokens=max(0, sp.min_new_tokens - len(toks)))
        seq = await run(list(ids) + toks, part, None, request, images=images)
        toks += seq.out_ids
        lps += seq.out_logprobs
        vers += seq.out_versions
        fin = dict(seq.finish or {})
        if fin.get("type") == "error":
            raise HTTPError(500, f"generation failed: {fin.get('message')}")
        if fin.get("type") == "abort":
            if fin.get("message") != PAUSE_ABORT:
                raise HTTPError(503, f"generation aborted: {fin.get('message')}")
            if len(toks) < sp.max_new_tokens:
                continue
            fin = {"type": "length", "length": len(toks)}
        return Sequence(rid=seq.rid, prompt_ids=list(ids), params=sp, on_done=lambda _s: None, out_ids=toks,
                        out_logprobs=lps, out_versions=vers, finish=fin)


def _sampling_for(body: dict, n: int, prompt_len: int, context_length: int) -> list[Any]:
    sp = openai_sampling({k: v for k, v in body.items() if k != "seed"},
                         max_tokens_key=("max_completion_tokens", "max_tokens"))
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        sp.max_new_tokens = max(0, context_length - prompt_len)  # OpenAI's default: the rest of the context
    return seeded(sp, body.get("seed"), n)


def seeded(sp: Any, seed: Any, n: int) -> list[Any]:
    """One sampling setting per choice; with ``seed``, choice ``i`` samples with seed ``seed + i``
    (the same request with the same seed gives the same choices)."""
    if seed is None:
        return [sp] * n
    if not isinstance(seed, int) or isinstance(seed, bool) or not -2**63 <= seed < 2**63:
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r}")
    return [dataclasses.replace(sp, sampling_seed=(seed + i) % 2**63) for i in range(n)]


def _choice(state: Any, h: Any, i: int, s: Any, parse: bool, parser: str, want_lp: bool,
            want_ids: bool, parallel: bool) -> dict:
    text = h.text_of(s)
    finish = "length" if s.finish.get("type") == "length" else "stop"
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if parse:
        parsed = TP.parse_tool_calls(text, parser)
        if parsed.tool_calls:
            calls = parsed.tool_calls if parallel else parsed.tool_calls[:1]
            msg = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
            if finish == "stop":
                finish = "tool_calls"
    c: dict[str, Any] = {"index": i, "message": msg, "finish_reason": finish, "logprobs": None}
    if want_lp:
        c["logprobs"] = logprobs_content(h.tok_str, s.out_ids, s.out_logprobs)
    if want_ids:
        c.update(token_ids=list(s.out_ids), token_logprobs=list(s.out_logprobs),
                 token_versions=list(s.out_versions))
    return c


def logprobs_content(tok_str: Callable[[int], str], ids: list[int], lps: list[float]) -> dict:
    """OpenAI's ``choices[i].logprobs``: one entry per generated token (the end-of-turn token included:
    it was sampled too), each the sampled token's logprob under the sampling temperature, the same
    numbers the trainer records; no alternatives (``top_logprobs`` > 0 is refused)."""
    return {"content": [{"token": tok_str(t), "logprob": float(v), "bytes": list(tok_str(t).encode()),
                         "top_logprobs": []} for t, v in zip(ids, lps)]}


def default_parser(state: Any) -> str:
    cfg = getattr(getattr(state.engine, "model", None), "config", None)
    return TP.parser_for_model_type(getattr(cfg, "model_type", None))


async def chat_completion(state: Any, h: Any, body: dict, request: Any) -> dict | AsyncIterator[bytes]:
    """The whole ``/v1/chat/completions`` route; a dict, or SSE bytes when ``stream`` is true."""
    import asyncio

    check_model(state, body)
    n = parse_n(body)
    refuse_unsupported(body)
    stream = body.get("stream", False)
    want_ids = body.get("return_token_ids", False)
    for k, v in (("stream", stream), ("return_token_ids", want_ids),
                 ("logprobs", body.get("logprobs", False)),
                 ("parallel_tool_calls", body.get("parallel_tool_calls", True))):
        if not isinstance(v, bool):
            raise BadRequest(f"{k} must be a boolean, got {v!r}")
    refs: list | None = [] if getattr(state, "media", None) is not None else None
    msgs = normalise_messages(body.get("messages"), refs)
    tools, tool_choice, parse = parse_tools(body)
    parser = body.get("tool_call_parser") or default_parser(state)
    try:
        TP.check_parser(parser)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    ids = render_prompt(state, msgs, tools, tool_choice, body)
    vis = None
    if refs or (refs is not None and state.media.count_runs(ids)):
        ids, vis = await asyncio.to_thread(state.media.prepare, ids, refs, "image_url")
    sps = _sampling_for(body, n, len(ids), state.context_length)
    from areal_cli.inference.server.schema import check_context

    check_context(len(ids), sps[0].max_new_tokens, state.context_length)
    seqs = await asyncio.gather(*[generate_resumable(h.run, ids, sp, request, vis) for sp in sps])
    choices = [_choice(state, h, i, s, parse, parser, bool(body.get("logprobs")), want_ids,
                       body.get("parallel_tool_calls", True)) for i, s in enumerate(seqs)]
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": state.served_model_name, "choices": choices, "usage": h.usage(seqs),
           "system_fingerprint": f"weight_version={state.engine.version}"}
    if want_ids:
        out["prompt_token_ids"] = ids
    if stream:
        opts = body.get("stream_options") or {}
        return sse_chunks(out, bool(isinstance(opts, dict) and opts.get("include_usage")))
    return out


async def sse_chunks(resp: dict, include_usage: bool) -> AsyncIterator[bytes]:
    """A finished completion as ``chat.completion.chunk`` server-sent events."""
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"],
            "model": resp["model"], "system_fingerprint": resp["system_fingerprint"]}

    def ev(choices: list, **extra: Any) -> bytes:
        return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

    for c in resp["choices"]:
        i, msg = c["index"], c["message"]
        yield ev([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if msg.get("content"):
            yield ev([{"index": i, "delta": {"content": msg["content"]}, "logprobs": c["logprobs"],
                       "finish_reason": None}])
        for k, call in enumerate(msg.get("tool_calls") or []):
            yield ev([{"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "finish_reason": None}])
        last = {"index": i, "delta": {}, "finish_reason": c["finish_reason"]}
        for key in ("token_ids", "token_logprobs", "token_versions"):
            if key in c:
                last[key] = c[key]
        extra = {"prompt_token_ids": resp["prompt_token_ids"]} if "prompt_token_ids" in resp else {}
        yield ev([last], **extra)
    if include_usage:
        yield ev([], usage=resp["usage"])
    yield b"data: [DONE]\n\n"
