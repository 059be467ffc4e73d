"""An in-process ``openai.AsyncOpenAI`` for agents inside a :class:`RolloutWorkflow`.

``ArealOpenAI(engine, tokenizer)`` *is* an ``openai.AsyncOpenAI``: agent code written for the SDK
(``client.chat.completions.create(...)``, ``client.responses.create(...)``, the OpenAI Agents SDK's
``OpenAIChatCompletionsModel(openai_client=client)``) runs unchanged and gets genuine SDK objects
(``ChatCompletion``, ``ChatCompletionChunk``, ``Response``). No HTTP is involved: each call renders
the chat template here and generates through the project's inference client (``engine.agenerate``),
so routing, resume after a weight-update abort (the agent never sees the abort; per-token versions
record where the policy changed) and per-episode seeding all apply.

Every call lands in :attr:`ArealOpenAI.cache`
(:class:`~areal_cli.rollout.interaction_cache.InteractionCache`).

Prompt construction (``prompt_mode``):
- ``"continue"`` (default): when an earlier call of the episode is this call's message parent, the
  prompt is the parent's *real* ids (prompt + output) followed by the template's rendering of what
  came after the assistant turn (its turn-closing text, tool results, the next generation header).
  Decoding and re-encoding the model's output would give other ids (retokenization drift: other
  logprobs, a KL spike); here the ids the model produced are the ids it is trained on. This holds for
  templates that rewrite earlier turns too (Qwen3 drops ``<think>…</think>`` from turns before the
  last user query, and the empty think block of its ``enable_thinking=False`` header): the new text
  is taken from the full render after the parent's turn, located by its count of end-of-turn markers,
  so the episode stays one token chain (one row) and the re-rendered history is never trained.
  ``Interaction.retokenized`` / ``render_diff_at`` record whether and where a fresh render would have
  differed; ``rewritten_history`` that the template re-rendered earlier turns differently.
  A parent cut at ``length`` gets the end-of-turn token added (masked).
  A parent that stopped on a ``stop`` string is closed the same way: its ids (the stop string's
  tokens included: the model sampled them, and they are trained) get the end-of-turn token (masked)
  and the template's closing text, so the context reads ``…output<|im_end|>\n<|im_start|>user…`` as
  the template renders the turn, not ``…output\n<|im_start|>user…``.
- ``"template"``: always a fresh render of the messages (then calls are only message-linked).

Request fields beyond ``create``'s named parameters: those without effect on generation by OpenAI's
semantics (``NO_EFFECT_FIELDS``: ``user``, ``metadata``, ...) are accepted, every other one is a 400
naming it (never silently ignored); ``extra_body``'s keys count as top-level fields, as over HTTP.

Errors surface as the ``openai`` SDK's own exceptions with the status a server would have answered
(``rollout/openai_errors.py``): a malformed request, or one the inference server refused (a prompt over its
context: ``RequestRejected`` with the server's status and message) is ``openai.BadRequestError``
(400) etc.; an inference server that failed after retries is ``openai.InternalServerError`` (502).
The original error is the exception's ``__cause__`` (episode retries look there for transport
failures). ``logprobs=True`` returns ``choices[0].logprobs.content`` (the sampled token's logprob per
generated token); ``top_logprobs`` > 0 is refused (400): the inference path has no alternatives.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from typing import Any

import openai

from areal_cli.api.io_struct import GenerationConfig, ModelRequest
from areal_cli.inference.server import tool_parsers as TP
from areal_cli.inference.server.openai_compat import (
    logprobs_content,
    normalise_messages,
    parse_tools,
    plain,
    refuse_unsupported,
)
from areal_cli.rollout.interaction_cache import Interaction, InteractionCache
from areal_cli.rollout.openai_errors import sdk_error

log = logging.getLogger(__name__)


def _given(v: Any) -> bool:
    return v is not None and not isinstance(v, (openai.NotGiven, openai.Omit))


# Chat-completion fields beyond the named parameters of ``create``. A field is honoured, accepted because
# by OpenAI's own semantics it has no effect on what is generated, or refused with a 400 naming it; none
# is silently ignored (an agent asking for a sampling knob must not train on samples drawn without it).
NO_EFFECT_FIELDS = {
    "user": "an end-user id (abuse tracking)",
    "safety_identifier": "an end-user id (abuse tracking)",
    "metadata": "tags for stored completions",
    "service_tier": "the processing tier (latency and price)",
    "prompt_cache_key": "a prompt-cache routing hint",
    "prompt_cache_retention": "how long a prompt cache is kept",
    "return_token_ids": "the token fields are always returned",
    "extra_headers": "transport option",
    "extra_query": "transport option",
    "timeout": "transport option",
}
# refused in ``openai_compat.refuse_unsupported`` when set to something the server cannot honour
_REFUSED_THERE = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "response_format",
                  "audio", "prediction", "web_search_options")
_WHY_NOT = {
    "reasoning_effort": "the chat template decides whether the model thinks (chat_template_kwargs, e.g. "
                        "{'enable_thinking': false} in extra_body)",
    "verbosity": "it has no meaning for this model",
    "functions": "use tools",
    "function_call": "use tool_choice",
    "tool_call_parser": "set it on the client (ArealOpenAI(tool_call_parser=...) / AgentProxy(..., "
                        "tool_call_parser=...))",
    "modalities": "only ['text'] is generated",
}


def refuse_unknown_fields(kwargs: dict) -> None:
    """400 for a chat-completion field that is neither honoured nor without effect (module table)."""
    from areal_cli.inference.server.schema import BadRequest

    for k, v in kwargs.items():
        if not _given(v) or k in NO_EFFECT_FIELDS or k in _REFUSED_THERE:
            continue
        if k == "modalities" and plain(v) == ["text"]:
            continue
        why = _WHY_NOT.get(k, "this client does not implement it")
        raise BadRequest(f"{k}={v!r} is not supported: {why}; it is refused rather than ignored so that "
                         "sampling is what the trainer assumes")


def _merge_extra_body(args: dict, kwargs: dict) -> dict:
    """``create``'s arguments with ``extra_body``'s keys at the top level, as the SDK sends them to a
    server (the proxy receives them there too), except ``chat_template_kwargs``, which stays in it."""
    from areal_cli.inference.server.schema import BadRequest

    extra = args.get("extra_body")
    out = {**args, **kwargs}
    if not _given(extra):
        return out
    extra = plain(extra)
    if not isinstance(extra, dict):
        raise BadRequest(f"extra_body must be an object, got {type(extra).__name__}")
    out["extra_body"] = {k: v for k, v in extra.items() if k == "chat_template_kwargs"}
    out.update({k: v for k, v in extra.items() if k != "chat_template_kwargs"})
    return out


def _check_request(model: Any, limit: Any, temperature: Any, top_p: Any, stop: Any, seed: Any, stream: Any,
                   logprobs: Any, top_logprobs: Any) -> None:
    """400 for field values a server would refuse (types, ranges), before anything is generated."""
    from areal_cli.inference.server.openai_compat import seeded
    from areal_cli.inference.server.schema import BadRequest, openai_sampling

    if _given(model) and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {type(model).__name__} {model!r}")
    sp = openai_sampling({k: v for k, v in (("max_tokens", limit), ("temperature", temperature),
                                            ("top_p", top_p), ("stop", stop)) if _given(v)},
                         max_tokens_key=("max_tokens",))
    seeded(sp, seed if _given(seed) else None, 1)
    for k, v in (("stream", stream), ("logprobs", logprobs)):
        if _given(v) and not isinstance(v, bool):
            raise BadRequest(f"{k} must be a boolean, got {v!r}")
    if _given(top_logprobs) and (not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool)
                                 or not 0 <= top_logprobs <= 20):
        raise BadRequest(f"top_logprobs must be an integer in [0, 20], got {top_logprobs!r}")


class _ChunkStream:
    """What ``create(stream=True)`` returns: an async iterator of ``ChatCompletionChunk``."""

    def __init__(self, chunks: list[Any]):
        self._chunks = chunks

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self._chunks:
            yield c

    async def __aenter__(self) -> "_ChunkStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def close(self) -> None:
        return None


class _Completions:
    def __init__(self, client: "ArealOpenAI"):
        self._c = client

    async def create(self, *, messages: Any = None, model: Any = None, tools: Any = None,
                     tool_choice: Any = None, max_tokens: Any = None, max_completion_tokens: Any = None,
                     temperature: Any = None, top_p: Any = None, stop: Any = None, seed: Any = None, n: Any = None,
                     stream: Any = None, stream_options: Any = None, extra_body: Any = None, store: Any = None,
                     parallel_tool_calls: Any = None, logprobs: Any = None, top_logprobs: Any = None,
                     **kwargs: Any) -> Any:
        args = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        try:
            return await self._create(**_merge_extra_body(args, kwargs))
        except Exception as e:
            err = sdk_error(self._c, e, "/chat/completions")
            if err is None or err is e:
                raise
            raise err from e

    async def _create(self, *, messages: Any, model: Any, tools: Any, tool_choice: Any, max_tokens: Any,
                      max_completion_tokens: Any, temperature: Any, top_p: Any, stop: Any, seed: Any, n: Any,
                      stream: Any, stream_options: Any, extra_body: Any, store: Any, parallel_tool_calls: Any,
                      logprobs: Any, top_logprobs: Any, **kwargs: Any) -> Any:
        c = self._c
        if _given(n) and n != 1:
            raise ValueError(f"n={n}: the in-process client makes one completion per call (each call is one "
                             "interaction in the cache); call create() n times")
        refuse_unknown_fields(kwargs)
        refuse_unsupported({**{k: v for k, v in kwargs.items() if _given(v)},
                            "top_logprobs": top_logprobs if _given(top_logprobs) else None})
        limit = max_completion_tokens if _given(max_completion_tokens) else max_tokens
        _check_request(model, limit, temperature, top_p, stop, seed, stream, logprobs, top_logprobs)
        body = {"tools": plain(tools) if _given(tools) else None,
                "tool_choice": plain(tool_choice) if _given(tool_choice) else None}
        tools_l, choice, parse = parse_tools(body)
        # image_url content parts (a vision-language tokenizer only): their references, in prompt order
        images: list | None = [] if c.takes_images else None
        msgs = normalise_messages(plain(list(messages)) if isinstance(messages, (list, tuple)) else messages,
                                  images)
        urls = _name_images(msgs, images or [])
        extra = dict(extra_body) if _given(extra_body) else {}
        stops = [stop] if isinstance(stop, str) else list(stop) if _given(stop) else []
        res = await c._complete(msgs, tools_l, choice, parse, limit if _given(limit) else None,
                                temperature if _given(temperature) else None,
                                top_p if _given(top_p) else None,
                                stops, seed if _given(seed) else None, extra,
                                parallel_tool_calls is not False, store is not False,
                                want_logprobs=logprobs is True, images=urls)
        if _given(stream) and stream:
            return _ChunkStream(c._chunks(res, bool(_given(stream_options) and
                                                    plain(stream_options).get("include_usage"))))
        return res


class _Chat:
    def __init__(self, client: "ArealOpenAI"):
        self.completions = _Completions(client)


class ArealOpenAI(openai.AsyncOpenAI):
    """See the module docstring. ``engine``: an ``InferenceEngine`` (what a workflow's
    ``arun_episode`` receives); ``tokenizer``: the policy's HF tokenizer."""

    def __init__(self, engine: Any, tokenizer: Any, *, tool_call_parser: str = "hermes",
                 prompt_mode: str = "continue", default_max_tokens: int = 512,
                 max_total_tokens: int | None = None, cache: InteractionCache | None = None,
                 model_name: str = "areal-policy", force_greedy: bool = False, session_id: str | None = None):
        """``force_greedy``: every call decodes greedily whatever temperature the agent asks for
        (evaluation runs the agent this way). ``session_id``: the routing key of every call (the client
        sends a session's calls to one server, whose prefix cache then holds its earlier turns; the
        members of a GRPO group share one); default: an id of this client's own."""
        super().__init__(api_key="areal-in-process", base_url="http://in-process.invalid/v1", max_retries=0)
        if prompt_mode not in ("continue", "template"):
            raise ValueError(f"prompt_mode must be 'continue' or 'template', got {prompt_mode!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.tool_call_parser = TP.check_parser(tool_call_parser)
        self.prompt_mode = prompt_mode
        self.default_max_tokens = int(default_max_tokens)
        self.max_total_tokens = max_total_tokens
        self.cache = cache if cache is not None else InteractionCache()
        self.model_name = model_name
        self.force_greedy = force_greedy
        self.session_id = session_id or uuid.uuid4().hex
        self._chat = _Chat(self)
        self._responses: Any = None
        from areal_cli.models.vl_inputs import vision_token_ids

        # a vision-language tokenizer: image_url parts are taken (docs/vision.md), else refused (400)
        self.takes_images = bool(vision_token_ids(tokenizer))

    @property
    def chat(self) -> _Chat:  # type: ignore[override]
        return self._chat

    @property
    def responses(self) -> Any:  # type: ignore[override]
        from areal_cli.rollout.openai_responses import Responses

        if self._responses is None:
            self._responses = Responses(self)
        return self._responses

    # rewards and export, on the episode's cache
    def set_reward(self, interaction_id: str, reward: float) -> None:
        self.cache.set_reward(interaction_id, reward)

    def set_last_reward(self, reward: float) -> None:
        self.cache.set_last_reward(reward)

    def apply_reward_discount(self, turn_discount: float) -> dict[str, float]:
        return self.cache.apply_discount(turn_discount)

    def export_interactions(self, style: str = "per_call") -> list[dict[str, Any]]:
        return self.cache.export(style)

    # ------------------------------------------------------------------ prompt
    def _render(self, msgs: list[dict], tools: list[dict] | None, gen: bool, kw: dict) -> str:
        if tools is not None:
            kw = {**kw, "tools": tools}
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)

    def _token_str(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt(self, msgs: list[dict], tools: list[dict] | None, kw: dict, expand: Any = None
                ) -> tuple[list[int], Interaction | None, Interaction | None, int | None, bool]:
        """``(prompt ids, message parent, token parent, first position where a fresh render differs,
        whether the template rewrote earlier turns)``. ``expand``: expands the prompt's image pads
        (a parent's are expanded already, a new image's placeholder is one pad)."""
        expand = expand or (lambda ids: ids)
        full_text = self._render(msgs, tools, True, kw)
        fresh = expand(self._encode(full_text))
        parent = self.cache.find_parent(msgs)
        if parent is None or self.prompt_mode != "continue" or parent.tools != tools:
            return fresh, parent, None, None, False
        split = self._after_turn(msgs, len(parent.messages), tools, kw, full_text)
        if split is None:
            log.warning("the chat template's rendering of call %s's assistant turn cannot be located in the "
                        "next render; that call gets a fresh render of its messages and starts a new "
                        "trained row", parent.id)
            return fresh, parent, None, None, False
        close, tail, rewritten = split
        ids = list(parent.input_ids) + list(parent.output_ids)
        eos_id = self.tokenizer.eos_token_id
        # A turn the model did not close itself (cut at ``length``, or stopped on a stop string) is
        # closed for it as the template closes turns (masked: the model did not sample it). A
        # template whose turns do not end with EOS (no ``close``) is closed with it only after ``length``.
        unclosed = not parent.output_ids or parent.output_ids[-1] != eos_id
        if eos_id is not None and unclosed and (close is not None or parent.stop_reason == "length"):
            ids.append(int(eos_id))
        ids = expand(ids + self._encode((close or "") + tail))
        return ids, parent, parent, _first_diff(ids, fresh), rewritten

    def _after_turn(self, msgs: list[dict], k: int, tools: list[dict] | None, kw: dict, full_text: str
                    ) -> tuple[str | None, str, bool] | None:
        """Where the next prompt leaves the template's text for assistant turn ``msgs[k]`` (the parent's
        output): ``(the turn's closing text after EOS, or None when turns do not end with EOS; the text
        of everything after it in ``full_text``: the new messages and the generation header; whether
        the template renders the earlier turns otherwise than they were sampled)``. None: not found.

        Templates that rewrite history (Qwen3 drops ``<think>…</think>`` from assistant turns before
        the last user query, and the empty ``<think>\n\n</think>\n\n`` its generation header adds
        when ``enable_thinking`` is false) change the text *before* the turn's end, never the number of
        turns: the turn ends at the same count of EOS markers in every render, so the text after that
        marker is the template's rendering of only what is new, whatever it did to earlier turns."""
        a_text = self._render(msgs[:k + 1], tools, False, kw)
        p_text = self._render(msgs[:k], tools, True, kw)
        appends = a_text.startswith(p_text) and full_text.startswith(a_text)
        eos = self.tokenizer.eos_token
        if not eos or eos not in a_text:
            return (None, full_text[len(a_text):], False) if appends else None
        close = a_text[a_text.rfind(eos) + len(eos):]
        pos = -len(eos)
        for _ in range(a_text.count(eos)):
            pos = full_text.find(eos, pos + len(eos))
            if pos < 0:
                return None
        rest = full_text[pos + len(eos):]
        if not rest.startswith(close):
            return None
        return close, rest[len(close):], not appends

    # ------------------------------------------------------------------ generation
    async def _complete(self, msgs: list[dict], tools: list[dict] | None, choice: Any, parse: bool,
                        limit: int | None, temperature: float | None, top_p: float | None, stops: list[str],
                        seed: int | None, extra: dict, parallel: bool, store: bool,
                        interaction_id: str | None = None, want_logprobs: bool = False,
                        images: list[str] | None = None) -> Any:
        from openai.types.chat import ChatCompletion

        kw = dict(extra.get("chat_template_kwargs") or {})
        expand = None
        if images:  # the images' pads expanded as the processor does (models/vl_inputs.py)
            from areal_cli.models import vl_inputs as I

            _, counts = I.image_features(I.image_processor_for(self.tokenizer), images)
            pad = I.image_pad_id(self.tokenizer)

            def expand(ids: list[int]) -> list[int]:
                return I.expand_pads(ids, pad, counts)
        ids, parent, tparent, diff_at, rewritten = self._prompt(msgs, tools, kw, expand)
        budget = self.default_max_tokens if limit is None else int(limit)
        if self.max_total_tokens is not None:
            room = self.max_total_tokens - len(ids)
            if room <= 0:
                raise ValueError(f"the prompt has {len(ids)} tokens, at or over max_total_tokens="
                                 f"{self.max_total_tokens}; end the episode or shorten the conversation")
            budget = min(budget, room)
        eos = self.tokenizer.eos_token_id
        t = 0.0 if self.force_greedy else 1.0 if temperature is None else float(temperature)
        g = GenerationConfig(temperature=t if t > 0 else 1.0, greedy=t <= 0,
                             top_p=1.0 if top_p is None else float(top_p), max_new_tokens=budget,
                             stop=stops, stop_token_ids=[int(eos)] if eos is not None else [], seed=seed)
        pad = None
        if images:
            from areal_cli.models.vl_inputs import image_pad_id

            pad = image_pad_id(self.tokenizer)
        resp = await self.engine.agenerate(ModelRequest(input_ids=list(ids), gconfig=g, session_id=self.session_id,
                                                        image_data=list(images) if images else None,
                                                        image_pad_id=pad))
        if images:
            from areal_cli.models.vl_inputs import check_served_prompt

            check_served_prompt(ids, resp.input_tokens)
        out = list(resp.output_tokens)
        body = out[:-1] if out and resp.stop_reason == "stop" and out[-1] == eos else out
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        for s in stops:  # OpenAI leaves the stop sequence out of the content
            if s and s in text:
                text = text[:text.index(s)]
        finish = "length" if resp.stop_reason == "length" else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parse:
            parsed = TP.parse_tool_calls(text, self.tool_call_parser)
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": parsed.tool_calls if parallel else parsed.tool_calls[:1]}
                finish = "tool_calls" if finish == "stop" else finish
        cid = interaction_id or f"chatcmpl-{uuid.uuid4().hex}"
        lps = logprobs_content(self._token_str, out, list(resp.output_logprobs)) if want_logprobs else None
        completion = ChatCompletion.model_validate({
            "id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": lps,
                         "token_ids": out, "token_versions": list(resp.output_versions)}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                      "total_tokens": len(ids) + len(out)},
            "prompt_token_ids": ids})
        if store:
            self.cache.add(Interaction(
                id=cid, messages=copy.deepcopy(msgs), tools=copy.deepcopy(tools), input_ids=list(ids),
                output_ids=out, logprobs=list(resp.output_logprobs), versions=list(resp.output_versions),
                stop_reason=resp.stop_reason, output_message=_template_message(message),
                parent_id=parent.id if parent else None, token_parent_id=tparent.id if tparent else None,
                retokenized=diff_at is not None, render_diff_at=diff_at, rewritten_history=rewritten,
                response=completion, images=list(images or [])))
        return completion

    def _chunks(self, comp: Any, include_usage: bool) -> list[Any]:
        from openai.types.chat import ChatCompletionChunk

        c = comp.choices[0]
        base = {"id": comp.id, "object": "chat.completion.chunk", "created": comp.created,
                "model": comp.model}
        chunks = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        if c.message.content:
            chunks.append({"index": 0, "delta": {"content": c.message.content}, "finish_reason": None})
        for k, call in enumerate(c.message.tool_calls or []):
            chunks.append({"index": 0, "delta": {"tool_calls": [{"index": k, **call.model_dump()}]},
                           "finish_reason": None})
        chunks.append({"index": 0, "delta": {}, "finish_reason": c.finish_reason})
        if c.logprobs is not None:  # with the text they belong to (on the last chunk when there is none)
            chunks[1 if c.message.content else -1]["logprobs"] = c.logprobs.model_dump()
        out = [ChatCompletionChunk.model_validate({**base, "choices": [ch]}) for ch in chunks]
        if include_usage:
            out.append(ChatCompletionChunk.model_validate({**base, "choices": [],
                                                           "usage": comp.usage.model_dump()}))
        return out


def _name_images(msgs: list[dict], refs: list[Any]) -> list[str]:
    """The images' data URLs, in prompt order, each also written into its ``{"type": "image"}`` part (as
    ``"image"``, which chat templates render as the placeholder too), so two calls with other images are
    other messages to the cache's parent search."""
    from areal_cli.models.vl_inputs import to_data_url

    urls = [to_data_url(r.get("url") if isinstance(r, dict) else r) for r in refs]
    k = 0
    for m in msgs:
        for part in m["content"] if isinstance(m.get("content"), list) else []:
            if part.get("type") == "image" and k < len(urls):
                part["image"] = urls[k]
                k += 1
    return urls


def _first_diff(ids: list[int], fresh: list[int]) -> int | None:
    """The first prompt position where ``fresh`` (a render of the messages) differs; None: equal."""
    for i, (a, b) in enumerate(zip(ids, fresh)):
        if a != b:
            return i
    return None if len(ids) == len(fresh) else min(len(ids), len(fresh))


def _template_message(message: dict) -> dict:
    """The assistant message as the next call's ``messages`` will carry it (normalised form)."""
    m = normalise_messages([json.loads(json.dumps(message))])[0]
    return m
