"""HTTP layer of the ``hf`` server: SGLang's native endpoints plus OpenAI-compatible completions."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from areal_cli.inference.server import openai_compat as OA
from areal_cli.inference.server import lora_routes
from areal_cli.inference.server import weights as W
from areal_cli.inference.server.lora import parse_request_adapters
from areal_cli.inference.server.engine import GenerationEngine, Sequence
from areal_cli.inference.server.sampling import SamplingParams
from areal_cli.inference.server.schema import (BadRequest, bucket_request, check_context, group_problem,
                                               openai_sampling, parse_sampling, parse_token_ids)

log = logging.getLogger("areal_cli.hf_server")

ADMIN_PATHS = {"/pause_generation", "/continue_generation", "/update_weights_from_disk",
               "/init_weights_update_group", "/update_weights_from_distributed", "/flush_cache",
               "/update_weight_version", "/destroy_weights_update_group", "/begin_weight_update",
               "/end_weight_update"} | lora_routes.PATHS
OPEN_PATHS = {"/health", "/health_generate"}
# Sequences one request may start (``n`` x prompts): a request for a million samples would fill the
# engine's queue and starve every other caller (found by the HTTP fuzz test).
MAX_SEQS_PER_REQUEST = 1024


@dataclass
class ServerState:
    engine: GenerationEngine
    tokenizer: Any
    model_path: str
    served_model_name: str
    context_length: int
    vocab_size: int
    allowed_roots: list[str]
    api_key: str | None = None
    receiver: W.DistributedReceiver | None = None
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # /generate as a plain ASGI handler in front of FastAPI (False: the FastAPI route, the old path).
    asgi_generate: bool = True
    # media.MediaHandler of a vision-language model (None: a text-only model; image content is a 400).
    media: Any = None


def _err(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}, "success": False, "message": message},
                        status_code=status)


async def _json(request: Request) -> dict:
    return _parse_json(await request.body())


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    v = float(text)
    if v - v != 0.0:  # inf (1e400 overflows): NaN never gets here, it is a constant
        raise BadRequest(f"number {text[:40]} is out of range (numbers must be finite)")
    return v


def _parse_json(raw: bytes) -> dict:
    if not raw:
        return {}
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    except RecursionError:  # json's recursive decoder on "[[[[..." thousands deep
        raise BadRequest("JSON body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


class _ApiKeyMiddleware:
    """Rejects requests without the api key (``/health`` stays open). A plain ASGI middleware, added
    only when a key is set: Starlette's ``@app.middleware("http")`` wraps every request in an extra
    task and body stream, and with tiny models per-request overhead is a visible share of a rollout."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, self.key):
                kind = "admin endpoint" if path in ADMIN_PATHS else "endpoint"
                await _err(401, f"{kind} {path} requires 'Authorization: Bearer <api-key>'")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="areal-cli hf server")
    app.state.s = state

    h = _helpers(state)
    generate = _generation_routes(app, state, h)
    if state.asgi_generate:  # added first: runs inside the api-key check (the last added is outermost)
        app.add_middleware(_GenerateEndpoint, handler=generate)
    if state.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest):
        return _err(400, str(exc))

    @app.exception_handler(OA.HTTPError)
    async def http_error(_request: Request, exc: OA.HTTPError):
        return _err(exc.status, str(exc))

    _openai_routes(app, state, h)
    _info_routes(app, state)
    _admin_routes(app, state, h)
    lora_routes.register(app, state, _json, h)
    return app


def _helpers(state: ServerState) -> SimpleNamespace:
    """Request plumbing shared by the route groups."""
    eng = state.engine

    async def run(ids: list[int], sp: SamplingParams, rid: str | None = None,
                  request: Request | None = None, gone: asyncio.Future | None = None,
                  record_mask: bool = False, lora: str | None = None, routing: bool = False,
                  images: Any = None) -> Sequence:
        """Generate ``ids``; a caller that hung up (``request.is_disconnected()``, polled each second,
        or ``gone`` completing) frees its batch slot."""
        check_context(len(ids), sp.max_new_tokens, state.context_length)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(seq: Sequence) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(seq))

        seq = Sequence(rid=rid or uuid.uuid4().hex, prompt_ids=list(ids), params=sp, on_done=done,
                       record_mask=record_mask, lora=lora, record_routing=routing, images=images)
        if sp.max_new_tokens == 0:
            seq.finish = {"type": "length", "length": 0}
            return seq
        eng.submit(seq)
        try:
            if gone is not None:
                await asyncio.wait((fut, gone), return_when=asyncio.FIRST_COMPLETED)
                if not fut.done():
                    eng.cancel(seq.rid)
                return await fut
            while True:
                done, _ = await asyncio.wait({fut}, timeout=1.0)
                if done:
                    return fut.result()
                if request is not None and await request.is_disconnected():
                    eng.cancel(seq.rid)
                    return await fut
        except asyncio.CancelledError:
            eng.cancel(seq.rid)
            raise

    def text_of(seq: Sequence) -> str:
        text = state.tokenizer.decode(seq.out_ids, skip_special_tokens=seq.params.skip_special_tokens)
        m = (seq.finish or {}).get("matched")
        if isinstance(m, str) and m in text:
            text = text[: text.index(m)]
        return text

    def sglang_out(seq: Sequence, return_logprob: bool, return_mask: bool = False,
                   routing_from: int | None = None) -> dict:
        meta = {
            "id": seq.rid, "finish_reason": seq.finish, "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.out_ids), "cached_tokens": seq.cached_tokens,
            "weight_version": str(seq.out_versions[-1] if seq.out_versions else eng.version),
            "output_token_weight_versions": list(seq.out_versions),
            "e2e_latency": (seq.finished_at or time.monotonic()) - seq.created,
            "ttft": (seq.first_token_at - seq.created) if seq.first_token_at else 0.0,
        }
        if seq.images is not None:  # hf extension: the prompt with each image's pads expanded (media.py)
            meta["prompt_token_ids"] = list(seq.prompt_ids)
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.out_logprobs, seq.out_ids)]
        if return_mask:  # an hf-server extension (Keep-Sampling-Mask); SGLang has no such field
            meta["output_token_sampling_cutoffs"] = list(seq.out_cutoffs)
            meta["output_token_sampling_logprobs"] = list(seq.out_masked_logprobs)
        if routing_from is not None:  # SGLang's: base64 int32 [prompt + completion - 1 - start, layers, k]
            from areal_cli.engines.routing_replay import encode

            meta["routed_experts"] = encode(seq.routing, routing_from)
        return {"text": text_of(seq), "output_ids": list(seq.out_ids), "meta_info": meta}

    def usage(seqs: list[Sequence]) -> dict:
        p = len(seqs[0].prompt_ids) if seqs else 0
        c = sum(len(s.out_ids) for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def oa_finish(seq: Sequence) -> str:
        return "length" if (seq.finish or {}).get("type") == "length" else "stop"

    def tok_str(t: int) -> str:
        return state.tokenizer.decode([t], skip_special_tokens=False)

    def oa_common(body: dict) -> int:
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the hf server")
        OA.check_model(state, body)
        OA.refuse_unsupported(body)
        return OA.parse_n(body)  # n=0 is a 400, not one sample

    def parse_version(body: dict, key: str = "weight_version") -> int | None:
        v = body.get(key)
        if v is None:
            return None
        try:
            out = int(v)
        except (TypeError, ValueError, OverflowError):
            raise BadRequest(f"{key} must be an integer (or its string form), got {v!r}") from None
        if not 0 <= out < 2**63:  # versions travel as int64 tensors on the trainer side
            raise BadRequest(f"{key} must be in [0, 2**63), got {v!r}")
        return out

    def set_version(v: int | None):
        if v is not None:
            eng.version = v

    return SimpleNamespace(run=run, text_of=text_of, sglang_out=sglang_out, usage=usage, oa_finish=oa_finish,
                           tok_str=tok_str, oa_common=oa_common, parse_version=parse_version,
                           set_version=set_version)


def _generation_routes(app: FastAPI, state: ServerState, h: SimpleNamespace):
    """Registers the FastAPI ``/generate`` route; returns ``generate(body, request, gone)`` (its logic)."""
    run, sglang_out = h.run, h.sglang_out

    async def generate(body: dict, request: Request | None = None, gone: asyncio.Future | None = None):
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the hf server; send stream=false")
        if body.get("top_logprobs_num"):
            raise BadRequest("top_logprobs_num is not supported by the hf server")
        ret_lp = body.get("return_logprob", False)
        if not isinstance(ret_lp, bool):
            raise BadRequest(f"return_logprob must be a boolean, got {ret_lp!r}")
        ret_mask = body.get("return_sampling_mask", False)
        if not isinstance(ret_mask, bool):
            raise BadRequest(f"return_sampling_mask must be a boolean, got {ret_mask!r}")
        raw_sp = body.get("sampling_params")
        sp = None if isinstance(raw_sp, list) else parse_sampling(raw_sp)
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            prompts = [parse_token_ids("input_ids", x, state.vocab_size) for x in (ids if batch else [ids])]
        elif body.get("text") is not None:
            text = body["text"]
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not texts or not all(isinstance(t, str) and t for t in texts):
                raise BadRequest("text must be a non-empty string or a list of them")
            prompts = [state.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        else:
            raise BadRequest("either input_ids or text is required")
        rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        if sp is None:  # SGLang's batch form: one sampling_params object per prompt
            if not batch or len(raw_sp) != len(prompts):
                raise BadRequest(f"sampling_params is a list of {len(raw_sp)}: it needs a batch of as many "
                                 f"prompts, got {len(prompts) if batch else 'a single prompt'}")
            sps = [parse_sampling(x) for x in raw_sp]
        else:
            sps = [sp] * len(prompts)
        if len(prompts) > MAX_SEQS_PER_REQUEST:
            raise BadRequest(f"a batch of {len(prompts)} prompts exceeds {MAX_SEQS_PER_REQUEST} per request")
        prompts, vis = await _with_images(state, body, prompts, batch)
        for p, s in zip(prompts, sps):
            check_context(len(p), s.max_new_tokens, state.context_length)
        loras = parse_request_adapters(body, len(prompts), batch, state.engine.adapters)  # SGLang's lora_path
        r_from = _routed_experts_start(body, prompts, state.engine)
        if any(v is not None for v in vis) and (r_from is not None or any(a is not None for a in loras)):
            raise BadRequest("requests with images run without LoRA adapters and routing replay on the hf server")
        if batch:
            seqs = await asyncio.gather(*[run(p, s, None, request, gone, ret_mask, a, r_from is not None, v)
                                          for p, s, a, v in zip(prompts, sps, loras, vis)])
            return [sglang_out(s, ret_lp, ret_mask, r_from) for s in seqs]
        seq = await run(prompts[0], sps[0], rid, request, gone, ret_mask, loras[0], r_from is not None, vis[0])
        return sglang_out(seq, ret_lp, ret_mask, r_from)

    @app.post("/generate")
    async def generate_route(request: Request):
        return JSONResponse(await generate(await _json(request), request))

    return generate


async def _with_images(state: ServerState, body: dict, prompts: list[list[int]],
                        batch: bool) -> tuple[list[list[int]], list[Any]]:
    """SGLang's ``image_data``: each prompt with its image pads expanded, and its images (None: none)."""
    from areal_cli.inference.server.media import refs_for_prompts

    image_data = body.get("image_data")
    if state.media is None:
        if image_data not in (None, [], [None] * len(prompts)):
            raise BadRequest(f"image_data was sent but {state.served_model_name} is a text-only model")
        return prompts, [None] * len(prompts)
    refs = refs_for_prompts(image_data, len(prompts), batch)
    out_p, out_v = [], []
    for i, (p, r) in enumerate(zip(prompts, refs)):
        if not r and not state.media.count_runs(p):
            out_p.append(p)
            out_v.append(None)
            continue
        where = f"image_data[{i}]" if batch else "image_data"
        ids, v = await asyncio.to_thread(state.media.prepare, p, r, where)
        out_p.append(ids)
        out_v.append(v)
    return out_p, out_v


def _routed_experts_start(body: dict, prompts: list[list[int]], engine: Any) -> int | None:
    """SGLang's ``return_routed_experts`` / ``routed_experts_start_len``: None when routing is not asked
    for, else the first position to return (routing replay, engines/routing_replay.py)."""
    want = body.get("return_routed_experts", False)
    if not isinstance(want, bool):
        raise BadRequest(f"return_routed_experts must be a boolean, got {want!r}")
    start = body.get("routed_experts_start_len", 0)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= min(len(p) for p in prompts):
        raise BadRequest(f"routed_experts_start_len must be an integer in [0, prompt tokens], got {start!r}")
    if not want:
        return None
    why = engine.routing_unsupported()
    if why is not None:
        raise BadRequest(f"return_routed_experts: {why}")
    return start


def _json_bytes(payload: Any) -> bytes:
    """Starlette's ``JSONResponse.render``, byte for byte."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


class _GenerateEndpoint:
    """``POST /generate`` served straight from ASGI, before FastAPI's router.

    Same validation, errors and JSON as the FastAPI route (which stays registered: ``asgi_generate=False``
    serves through it). Why: a rollout batch is 64 small requests, and with a tiny model FastAPI's
    per-request work (route matching, dependency solving, ``Request`` wrappers, the 1 s disconnect poll)
    was ~20% of the server's CPU. Disconnects are seen by one pending ``receive()`` per request instead.
    """

    def __init__(self, app: Any, handler: Any):
        self.app = app
        self.handler = handler

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        gone = asyncio.ensure_future(receive())  # completes with http.disconnect if the caller hangs up
        try:
            payload = await self.handler(_parse_json(b"".join(chunks)), None, gone)
        except BadRequest as e:
            await _err(400, str(e))(scope, receive, send)
            return
        finally:
            gone.cancel()
        body = _json_bytes(payload)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()),
                                (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def _openai_routes(app: FastAPI, state: ServerState, h: SimpleNamespace) -> None:
    eng = state.engine
    run, text_of, usage, oa_finish, tok_str, oa_common = h.run, h.text_of, h.usage, h.oa_finish, h.tok_str, h.oa_common

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        n = oa_common(body)
        if body.get("echo"):
            raise BadRequest("echo=true is not supported by the hf server")
        sp = openai_sampling(body, max_tokens_key=("max_tokens",))
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            ids = parse_token_ids("prompt", prompt, state.vocab_size)
        else:
            raise BadRequest("prompt must be a non-empty string or a list of token ids")
        if state.media is not None and state.media.count_runs(ids):
            raise BadRequest("the prompt has image placeholders; send images with /v1/chat/completions "
                             "(image_url parts) or /generate (image_data)")
        want_lp = body.get("logprobs")
        if want_lp is not None and (not isinstance(want_lp, int) or isinstance(want_lp, bool) or want_lp < 0):
            raise BadRequest(f"logprobs must be a non-negative integer, got {want_lp!r}")
        check_context(len(ids), sp.max_new_tokens, state.context_length)
        sps = OA.seeded(sp, body.get("seed"), n)
        seqs = await asyncio.gather(*[OA.generate_resumable(run, ids, p, request) for p in sps])
        choices = []
        for i, s in enumerate(seqs):
            c: dict[str, Any] = {"index": i, "text": text_of(s), "finish_reason": oa_finish(s), "logprobs": None}
            if want_lp is not None:
                toks = [tok_str(t) for t in s.out_ids]
                offs, acc = [], 0
                for t in toks:
                    offs.append(acc)
                    acc += len(t)
                c["logprobs"] = {"tokens": toks, "token_logprobs": list(s.out_logprobs),
                                 "top_logprobs": [{t: lp} for t, lp in zip(toks, s.out_logprobs)],
                                 "text_offset": offs}
            choices.append(c)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": state.served_model_name, "choices": choices, "usage": usage(seqs),
                "system_fingerprint": f"weight_version={eng.version}"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        out = await OA.chat_completion(state, h, await _json(request), request)
        if isinstance(out, dict):
            return out
        return StreamingResponse(out, media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.served_model_name, "object": "model",
                                            "created": 0, "owned_by": "areal-cli",
                                            "max_model_len": state.context_length}]}


def _info_routes(app: FastAPI, state: ServerState) -> None:
    eng = state.engine

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/model_info")  # SGLang's name; the client reads weight_version here
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "served_model_name": state.served_model_name, "context_length": state.context_length,
                "weight_version": str(eng.version), "vocab_size": state.vocab_size}

    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": str(eng.version)}

    @app.get("/get_load")
    async def get_load():
        return {**eng.load(), "paused": eng.paused, "stats": eng.cache_stats()}


def _check_group_request(body: dict) -> None:
    """Values of a typed ``/init_weights_update_group`` body that cannot form a group (400s)."""
    for k in ("master_address", "group_name"):
        if not body[k].strip():
            raise BadRequest(f"{k} must be a non-empty string")
    if not 1 <= body["master_port"] <= 65535:
        raise BadRequest(f"master_port must be in [1, 65535], got {body['master_port']}")
    ws, rank = body["world_size"], body["rank_offset"]
    if ws < 2 or not 1 <= rank < ws:
        raise BadRequest(f"need world_size >= 2 and 1 <= rank_offset < world_size (the trainer is rank 0), "
                         f"got rank_offset={rank}, world_size={ws}")
    t = body.get("timeout_s", 120.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400:
        raise BadRequest(f"timeout_s must be a number of seconds in (0, 86400], got {t!r}")


def _admin_routes(app: FastAPI, state: ServerState, h: SimpleNamespace) -> None:
    eng = state.engine
    parse_version, set_version = h.parse_version, h.set_version

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await _json(request)
        mode = body.get("mode", "abort")
        if mode != "abort":
            raise BadRequest(f"pause mode {mode!r} is not supported; the hf server implements 'abort'")
        n = await asyncio.wrap_future(eng.pause())
        return {"success": True, "message": f"paused; {n} running request(s) aborted", "num_aborted": n}

    @app.post("/continue_generation")
    async def cont(request: Request):
        await _json(request)
        await asyncio.wrap_future(eng.resume())
        return {"success": True, "message": "generation continued"}

    @app.post("/flush_cache")
    async def flush_cache():
        # Any engine command starts a new weights epoch, which drops the prefix cache (engine._new_epoch);
        # KV rows of running requests are per-request and freed on exit.
        await asyncio.wrap_future(eng.call(lambda: None))
        return {"success": True, "message": "prefix cache flushed"}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _json(request)
        v = parse_version(body, "new_version")
        if v is None:
            raise BadRequest("new_version is required")
        await asyncio.wrap_future(eng.call(lambda: set_version(v)))
        return {"success": True, "new_version": str(v)}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request):
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path (a directory of HF safetensors) is required")
        fmt = body.get("load_format")
        if fmt not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {fmt!r} is not supported; use 'safetensors'")
        version = parse_version(body)
        async with state.weight_lock:
            try:
                tensors = await asyncio.to_thread(W.load_from_disk, eng.model, path, state.allowed_roots)
            except PermissionError as e:
                return _err(403, str(e))
            except FileNotFoundError as e:
                return _err(404, str(e))
            except W.WeightUpdateRejected as e:
                return _err(400, str(e))
            except Exception as e:  # unreadable file: the model is untouched
                return _err(400, f"could not read weights from {path}: {e}")
            n = await asyncio.wrap_future(eng.call(lambda: (W.apply(eng.model, tensors), set_version(version))[0]))
        return {"success": True, "message": f"loaded {n} tensors from {path}", "num_paused_requests": 0,
                "weight_version": str(eng.version)}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await _json(request)
        need = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
                "group_name": str}
        for k, t in need.items():
            if not isinstance(body.get(k), t) or isinstance(body.get(k), bool):
                raise BadRequest(f"{k} ({t.__name__}) is required")
        _check_group_request(body)
        backend = body.get("backend", "gloo")
        if state.receiver is not None:
            state.receiver.close()
            state.receiver = None
        try:
            state.receiver = await asyncio.to_thread(
                W.DistributedReceiver.join, body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], body["group_name"], backend, float(body.get("timeout_s", 120.0)))
        except W.WeightUpdateRejected as e:
            return _err(400, str(e))
        except (OSError, RuntimeError, ValueError) as e:
            # The master named in the request could not be resolved, reached or joined in time
            # (TCPStore raises these): the request's peer, not this server, is what failed.
            return _err(400, f"could not join weight-update group {body['group_name']} at "
                             f"{body['master_address']}:{body['master_port']}: {e}")
        except Exception as e:
            return _err(500, f"could not join weight-update group {body['group_name']} at "
                             f"{body['master_address']}:{body['master_port']}: {e}")
        return {"success": True, "message": f"joined {body['group_name']} as rank {body['rank_offset']}"}

    # SGLang's weight-update session: distributed updates only between begin and end, and no
    # second begin while one is open (a trainer that forgets either fails here as on SGLang).
    session = {"open": False}

    @app.post("/begin_weight_update")
    async def begin_update(request: Request):
        await _json(request)
        if session["open"]:
            return _err(400, "a weight-update session is already open; call /end_weight_update first")
        session["open"] = True
        return {"success": True, "message": "weight-update session opened"}

    @app.post("/end_weight_update")
    async def end_update(request: Request):
        await _json(request)
        if not session["open"]:
            return _err(400, "no weight-update session is open; call /begin_weight_update first")
        session["open"] = False
        return {"success": True, "message": "weight-update session closed"}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        await _json(request)
        if state.receiver is not None:
            state.receiver.close()
            state.receiver = None
        return {"success": True, "message": "weight-update group destroyed"}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        body = await _json(request)
        # SGLang's load_format="flattened_bucket" (one uint8 broadcast); the older hf-only
        # "flattened_bucket": true is accepted as the same thing.
        names, dtypes, shapes, by_format = bucket_request(body)
        if not session["open"]:
            return _err(400, "update_weights_from_distributed must run between /begin_weight_update and "
                             "/end_weight_update")
        rec = state.receiver
        if (problem := group_problem(rec, body)) is not None:
            return _err(400, problem)
        flattened = body.get("flattened_bucket", False)
        if not isinstance(flattened, bool):
            raise BadRequest("flattened_bucket (bool) must be true or false")
        flattened = flattened or by_format
        # hf extension: pause right before / continue right after applying this bucket (saves the
        # trainer two round trips per push; see W.queue_apply)
        pause_gen, cont_gen = body.get("pause_generation", False), body.get("continue_generation", False)
        if not (isinstance(pause_gen, bool) and isinstance(cont_gen, bool)):
            raise BadRequest("pause_generation and continue_generation (bool) must be true or false")
        version = parse_version(body)
        problem = W.check_update_request(eng.model, names, dtypes, shapes)
        drainable = len(names) == len(dtypes) == len(shapes) and all(
            isinstance(s, list) for s in shapes)
        if problem is None and flattened:
            try:
                W.flat_layout(dtypes, shapes)
            except W.WeightUpdateRejected as e:  # no layout to drain into either
                problem, drainable = str(e), False

        def apply(tensors):
            return W.queue_apply(eng, tensors, version, pause=pause_gen, resume=cont_gen)

        async with state.weight_lock:
            if problem is not None:
                if drainable:
                    try:  # keep the collective in step with the trainer, then reject
                        await asyncio.to_thread(rec.drain, names, dtypes, shapes, flattened)
                    except Exception:
                        pass
                return _err(400, f"rejected weight update (nothing applied): {problem}")
            try:
                applied = await asyncio.to_thread(rec.receive_and_apply, names, dtypes, shapes, flattened, apply)
            except W.ReceiveFailed as e:
                return _err(500, f"broadcast receive failed in group {rec.group_name}: {e}")
        # The copy runs between two decode steps while the next bucket is already being received.
        # shield: a cancelled request must not cancel the queued copy (its slot is freed when done).
        n = await asyncio.shield(asyncio.wrap_future(applied))
        return {"success": True, "message": f"updated {n} tensors", "weight_version": str(eng.version)}

