"""Proxy mode: an OpenAI-compatible HTTP endpoint for agents in other processes or languages.

One :class:`AgentProxy` serves many episodes ("sessions"). Each session has its own interaction
cache (an :class:`~areal_cli.rollout.openai_client.ArealOpenAI` over the trainer's inference client)
and its own secret key; the agent is handed ``base_url=<proxy>/v1`` and ``api_key=<session key>``
and uses any OpenAI client unchanged.

| endpoint | key | what |
|---|---|---|
| ``POST /rl/grant_capacity`` ``{n=1}`` | admin | allow ``n`` more sessions (the staleness gate) |
| ``POST /rl/start_session`` ``{task_id?, greedy?}`` | admin | 429 without capacity; else ``{session_id, api_key}`` |
| ``POST /v1/chat/completions``, ``GET /v1/models`` | session | the in-process client's (SSE: ``stream``) |
| ``POST /rl/set_reward`` ``{interaction_id?, reward}`` | session | no id: the last call; 400 empty/unknown |
| ``POST /rl/end_session`` | session | no more calls; 410 if already ended |
| ``POST /rl/export`` ``{session_id, style, turn_discount?}`` | admin | 409 before end; rows (+ ``tool_calls``) once, then 404 |

A chat call answers what the inference server answered: a request it refuses (a prompt over its
context, malformed messages or tools, a field of the wrong type, ``top_logprobs`` > 0) is a 4xx with
the server's message, never a 500, and the session and its connection stay usable;
``logprobs: true`` is honoured (``choices[0].logprobs.content``); a field that is neither honoured nor
without effect on generation is a 400 naming it (``openai_client.NO_EFFECT_FIELDS``). A missing or unknown key is 401; an admin key on a session endpoint, or a session key on an admin
endpoint, is 403. A key only ever reaches its own session (the key *is* the session's identity).
Sessions idle for longer than ``session_timeout_s`` are collected (on every request and by
:meth:`AgentProxy.collect_idle`), never while a call of theirs is generating; collecting one returns
its capacity unit to nobody (it was used). The online gateway (``rollout/gateway.py``) is this proxy
with the trainer's staleness gate granting the sessions and every ended session exported to training.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import openai
from fastapi import Request  # a module global: FastAPI resolves the handlers' string annotations here

from areal_cli.errors import InferenceError
from areal_cli.rollout.openai_client import ArealOpenAI
from areal_cli.rollout.openai_errors import error_status


@dataclass
class _Session:
    id: str
    key: str
    client: ArealOpenAI
    last_used: float = field(default_factory=time.monotonic)
    ended: bool = False
    busy: int = 0  # calls in flight: a session is never collected while it generates


class AgentProxy:
    def __init__(self, engine: Any, tokenizer: Any, *, admin_key: str | None = None,
                 session_timeout_s: float = 3600.0, **client_kwargs: Any):
        self.engine = engine
        self.tokenizer = tokenizer
        self.admin_key = admin_key or secrets.token_urlsafe(32)
        self.session_timeout_s = float(session_timeout_s)
        self.client_kwargs = client_kwargs
        self.capacity = 0
        self.collected = 0
        self._sessions: dict[str, _Session] = {}  # by session id
        self._by_key: dict[str, str] = {}
        self._count = 0
        # The routes run on the server's loop; an online gateway also collects idle sessions and takes
        # grants from other threads, so every change to the sessions happens under this lock.
        self._lock = threading.RLock()
        self.drop_on_disconnect = False  # the online gateway drops a session whose agent hung up mid-call

    # ------------------------------------------------------------------ state
    def collect_idle(self) -> list[str]:
        with self._lock:
            now = time.monotonic()
            gone = [s for s in self._sessions.values()
                    if not s.busy and now - s.last_used > self.session_timeout_s]
            for s in gone:
                self._drop(s)
                self._on_collected(s, f"no request for {self.session_timeout_s:g}s (session_timeout_s)")
            self.collected += len(gone)
        return [s.id for s in gone]

    def _on_collected(self, s: _Session, why: str) -> None:
        """A session dropped unended, for ``why`` (the online gateway releases what it was granted)."""

    def _on_end(self, s: _Session) -> dict[str, Any] | None:
        """``/rl/end_session``: no more calls; the rows wait for ``/rl/export`` (the gateway exports
        them at once). None: the session was dropped meanwhile."""
        s.ended = True
        self._end_route(s)
        return {"session_id": s.id, "interaction_count": len(s.client.cache)}

    def take(self, session_id: str) -> ArealOpenAI | None:
        """Remove an ended session without exporting it (an evaluation's): its client, with the calls and
        rewards it recorded; None when there is no such session."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                self._drop(s)
        return None if s is None else s.client

    def _drop(self, s: _Session) -> None:
        with self._lock:
            self._sessions.pop(s.id, None)
            self._by_key.pop(s.key, None)
        self._end_route(s)

    def _end_route(self, s: _Session) -> None:
        """The inference client may forget which server served this session (session affinity)."""
        end = getattr(self.engine, "end_session", None)
        if end is not None:
            end(s.client.session_id)

    def build_app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        from areal_cli.inference.server.schema import BadRequest

        app = FastAPI(title="areal-cli agent proxy")

        def err(status: int, msg: str) -> JSONResponse:
            return JSONResponse({"error": {"message": msg, "code": status}}, status_code=status)

        def key_of(request: Request) -> str | None:
            h = request.headers.get("authorization", "")
            return h[7:] if h[:7].lower() == "bearer " else request.headers.get("x-api-key")

        def is_admin(key: str | None) -> bool:
            return key is not None and hmac.compare_digest(key.encode(), self.admin_key.encode())

        def admin(request: Request) -> JSONResponse | None:
            self.collect_idle()
            key = key_of(request)
            if is_admin(key):
                return None
            if key in self._by_key:
                return err(403, "this endpoint needs the admin key, not a session key")
            return err(401, "missing or unknown admin key ('Authorization: Bearer <admin key>')")

        def session(request: Request, live: bool = False) -> _Session | JSONResponse:
            """The caller's session, or the error to return: 401/403 for a bad key, and with ``live``
            410 once the agent has ended the session."""
            self.collect_idle()
            key = key_of(request)
            if is_admin(key):
                return err(403, "the admin key has no session; use the key start_session returned")
            with self._lock:
                s = self._sessions.get(self._by_key.get(key or "", ""))
            if s is None:
                return err(401, "missing or unknown session key (it may have ended and been exported, or "
                                "been collected after idling)")
            if live and s.ended:
                return err(410, f"session {s.id} has ended")
            s.last_used = time.monotonic()
            return s

        async def body(request: Request) -> dict:
            raw = await request.body()
            try:
                out = json.loads(raw) if raw else {}
            except ValueError:
                raise BadRequest("malformed JSON body") from None
            if not isinstance(out, dict):
                raise BadRequest("the body must be a JSON object")
            return out

        @app.exception_handler(BadRequest)
        async def bad(_r: Request, e: BadRequest):
            return err(400, str(e))

        @app.exception_handler(ValueError)
        async def bad_value(_r: Request, e: ValueError):
            return err(400, str(e))

        # The in-process client raises what the SDK would (openai.BadRequestError, ...) with the
        # status the inference server gave; the agent gets that status and message, not a 500, and
        # its connection stays open for the next call.
        @app.exception_handler(openai.APIStatusError)
        async def api_status(_r: Request, e: openai.APIStatusError):
            return err(e.status_code, e.message)

        @app.exception_handler(InferenceError)
        async def inference(_r: Request, e: InferenceError):
            return err(*(error_status(e) or (502, str(e))))

        h = SimpleNamespace(err=err, admin=admin, session=session, body=body, JSONResponse=JSONResponse,
                            StreamingResponse=StreamingResponse, BadRequest=BadRequest)
        self._admin_routes(app, h)
        self._session_routes(app, h)
        return app

    def _admin_routes(self, app: Any, h: SimpleNamespace) -> None:
        err, admin, body, BadRequest = h.err, h.admin, h.body, h.BadRequest

        @app.post("/rl/grant_capacity")
        async def grant(request: Request):
            if (r := admin(request)) is not None:
                return r
            n = (await body(request)).get("n", 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise BadRequest(f"n must be a positive integer, got {n!r}")
            self.capacity += n
            return {"capacity": self.capacity}

        @app.post("/rl/start_session")
        async def start(request: Request):
            if (r := admin(request)) is not None:
                return r
            b = await body(request)
            greedy = b.get("greedy", False)
            if not isinstance(greedy, bool):
                raise BadRequest(f"greedy must be true or false, got {greedy!r}")
            if self.capacity <= 0:
                return err(429, "no capacity: the trainer has not granted another episode yet "
                                "(staleness gate)")
            self.capacity -= 1
            self._count += 1
            sid = f"{b.get('task_id', 'session')}-{self._count}"
            key = secrets.token_urlsafe(32)
            # greedy: an evaluation session, every call decoded greedily whatever the agent asks for
            client = ArealOpenAI(self.engine, self.tokenizer, force_greedy=greedy, **self.client_kwargs)
            self._sessions[sid] = _Session(sid, key, client)
            self._by_key[key] = sid
            return {"session_id": sid, "api_key": key}

        @app.post("/rl/export")
        async def export(request: Request):
            if (r := admin(request)) is not None:
                return r
            b = await body(request)
            s = self._sessions.get(b.get("session_id", ""))
            if s is None:
                return err(404, f"no session {b.get('session_id')!r} (never started, already exported, "
                                "or collected)")
            if not s.ended:
                return err(409, f"session {s.id} has not ended; the agent calls /rl/end_session first")
            if b.get("turn_discount") is not None:
                s.client.apply_reward_discount(float(b["turn_discount"]))
            rows = s.client.export_interactions(b.get("style", "per_call"))
            calls = sum(len(it.output_message.get("tool_calls") or []) for it in s.client.cache)
            for row in rows:  # the session's tool use on each of its rows, as the agent workflow does
                row["tool_calls"] = calls
            self._drop(s)
            return {"session_id": s.id, "rows": rows}

    def _session_routes(self, app: Any, h: SimpleNamespace) -> None:
        err, session, body, JSONResponse, StreamingResponse = (h.err, h.session, h.body, h.JSONResponse,
                                                               h.StreamingResponse)
        BadRequest = h.BadRequest

        @app.get("/v1/models")
        async def models(request: Request):
            s = session(request)
            if isinstance(s, JSONResponse):
                return s
            return {"object": "list", "data": [{"id": s.client.model_name, "object": "model", "created": 0,
                                                "owned_by": "areal-cli"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            s = session(request, live=True)
            if isinstance(s, JSONResponse):
                return s
            b = await body(request)
            if "extra_body" in b:  # an SDK argument; its keys travel at the top level of the body
                raise BadRequest("extra_body is not a request field; send its keys at the top level")
            extra = {k: b.pop(k) for k in ("chat_template_kwargs",) if k in b}
            b.pop("return_token_ids", None)  # the in-process client always adds the token fields
            s.busy += 1
            try:
                out = await s.client.chat.completions.create(**b, extra_body=extra or None)
            finally:
                s.busy -= 1
                s.last_used = time.monotonic()
            if self.drop_on_disconnect and await request.is_disconnected():
                # The agent never got this answer, so the recorded conversation is not the one it goes
                # on with: the whole session is dropped (the gateway's "abandoned"), none of it trained.
                self._abandon(s, "the agent disconnected during a call")
                return err(499, f"session {s.id} dropped: the client disconnected during the call")
            if not b.get("stream"):
                return JSONResponse(out.model_dump(exclude_none=True))

            async def sse():
                async for chunk in out:
                    yield b"data: " + chunk.model_dump_json(exclude_none=True).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        @app.post("/rl/set_reward")
        async def set_reward(request: Request):
            s = session(request, live=True)
            if isinstance(s, JSONResponse):
                return s
            b = await body(request)
            iid = b.get("interaction_id")
            try:
                if iid is None:
                    s.client.set_last_reward(b.get("reward"))
                else:
                    s.client.set_reward(iid, b.get("reward"))
            except (KeyError, RuntimeError) as e:
                return err(400, str(e).strip("'\""))
            return {"ok": True}

        @app.post("/rl/end_session")
        async def end(request: Request):
            s = session(request, live=True)
            if isinstance(s, JSONResponse):
                return s
            out = self._on_end(s)
            if out is None:  # collected by another thread since the key was checked
                return err(401, f"session {s.id} was dropped before it ended (idle past session_timeout_s)")
            return out

    def _abandon(self, s: _Session, why: str) -> None:
        """Drop ``s`` whole, unended (see :meth:`_on_collected`)."""
        with self._lock:
            if s.id not in self._sessions:
                return
            self._drop(s)
            self._on_collected(s, why)


@dataclass
class ProxyServer:
    """A proxy served by uvicorn on a thread of this process (``stop()`` to end it)."""

    proxy: AgentProxy
    address: str
    server: Any
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://{self.address}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_proxy(proxy: AgentProxy, host: str = "127.0.0.1", port: int = 0,
                timeout_s: float = 30.0) -> ProxyServer:
    import uvicorn

    from areal_cli.utils.network import find_free_port

    port = port or find_free_port(host)
    # keep-alive beyond the agents' clients' own idle limits (httpx: 5 s, uvicorn's default too): a call
    # sent on a connection the proxy is closing fails with a read error, and an episode with it
    server = uvicorn.Server(uvicorn.Config(proxy.build_app(), host=host, port=port, log_level="warning",
                                           access_log=False, loop="asyncio", timeout_keep_alive=75))
    t = threading.Thread(target=server.run, name="areal-agent-proxy", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not t.is_alive():
            raise RuntimeError(f"the agent proxy did not start on {host}:{port}")
        time.sleep(0.02)
    return ProxyServer(proxy, f"{host}:{port}", server, t)


__all__ = ["AgentProxy", "ProxyServer", "serve_proxy"]
