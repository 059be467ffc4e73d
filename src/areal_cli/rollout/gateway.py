"""Online service mode: the proxy as a long-lived gateway that an agent service outside the trainer calls
at its own pace (``workflow.name=online``, ``rollout/workflows/online.py``).

The trainer's rollout executor admits episodes through the staleness gate as always; each admitted
episode :meth:`OnlineGateway.grant`\\ s one *ticket* (the capacity for one session) and waits on it.
The service opens a session, which takes the oldest open ticket, talks to the policy through the
session's OpenAI route, sets rewards and ends it; the end exports the session's rows and hands them to
the ticket's episode, which becomes a trajectory in the executor's output queue, released in the order
of the version it was admitted at. So

- capacity is the staleness gate's: with no open ticket ``start_session`` answers 429 (retry later);
- a session's tokens keep the versions recorded when they were generated (the ticket was granted at
  a version no newer than any of them, so the staleness bound holds as for any episode);
- a session is exported once, at its end, into exactly one episode: it is never trained twice;
- a session that is not ended (no request for ``session_timeout_s``, or the agent hung up during a
  call) is dropped whole, counted in ``online/abandoned``; its episode ends without a trajectory (the
  executor's "rejected": the capacity is free again) and no row of it is ever trained.

| endpoint | key | what |
|---|---|---|
| ``POST /rl/start_session`` ``{task_id?}`` | service | 429 without capacity; else a session (below) |
| ``GET /rl/gateway`` | service | capacity (open tickets), open sessions and the ``online/*`` counters |
| ``POST /v1/chat/completions``, ``GET /v1/models`` | session | as in :mod:`areal_cli.rollout.proxy` |
| ``POST /rl/set_reward`` ``{interaction_id?, reward}`` | session | no id: the last call |
| ``POST /rl/end_session`` | session | the session goes to training; ``{session_id, interaction_count}`` |

A session is ``{session_id, api_key, base_url, task}``: any OpenAI client on ``base_url`` with
``api_key``; ``task`` is the trainer's dataset item the ticket was granted for (a service that brings
its own tasks ignores it). ``grant_capacity`` and ``export`` are the trainer's here: the service
calling them would bypass the gate or take a session from training, so they answer 403.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fastapi import Request  # a module global: FastAPI resolves the handlers' string annotations here

from areal_cli.rollout.proxy import AgentProxy, ProxyServer, _Session, serve_proxy

log = logging.getLogger(__name__)

GATEWAY_FILE = "gateway.json"


@dataclass
class _Ticket:
    data: dict[str, Any]
    future: Future = field(default_factory=Future)


@dataclass
class GatewayStats:
    opened: int = 0
    ended: int = 0  # ended sessions handed to training (empty ones included)
    empty: int = 0  # ended without a single call: nothing to train
    abandoned: int = 0  # dropped unended: idle past session_timeout_s, or the agent hung up mid-call


class OnlineGateway(AgentProxy):
    """See the module docstring. ``service_key``: the key the service opens sessions with (the proxy's
    admin key; a random one by default). ``export_style`` / ``turn_discount``: as for ``/rl/export``."""

    def __init__(self, engine: Any, tokenizer: Any, *, service_key: str | None = None,
                 session_timeout_s: float = 600.0, export_style: str = "per_leaf",
                 turn_discount: float | None = None, **client_kwargs: Any):
        super().__init__(engine, tokenizer, admin_key=service_key, session_timeout_s=session_timeout_s,
                         **client_kwargs)
        if export_style not in ("per_call", "per_leaf"):
            raise ValueError(f"export_style must be 'per_call' or 'per_leaf', got {export_style!r}")
        self.export_style = export_style
        self.turn_discount = turn_discount
        self.drop_on_disconnect = True
        self.stats = GatewayStats()
        self._tickets: deque[_Ticket] = deque()
        self._held: dict[str, _Ticket] = {}  # session id -> the ticket it took
        self.base_url = ""  # set once served: what start_session hands out

    # ------------------------------------------------------------------ the trainer's side
    def grant(self, data: dict[str, Any]) -> Future:
        """One more session may open; the future gets its rows at the session's end, or None when it
        was dropped (abandoned, or ended empty). Cancel the future to withdraw an unused grant."""
        t = _Ticket(dict(data))
        with self._lock:
            self._tickets.append(t)
        return t.future

    def counters(self) -> dict[str, float]:
        with self._lock:
            s = self.stats
            return {"online/opened": s.opened, "online/ended": s.ended, "online/empty": s.empty,
                    "online/abandoned": s.abandoned, "online/open_sessions": len(self._sessions),
                    "online/capacity": float(sum(not t.future.cancelled() for t in self._tickets))}

    def _prune(self) -> None:
        while self._tickets and self._tickets[0].future.cancelled():
            self._tickets.popleft()

    @staticmethod
    def _resolve(t: _Ticket | None, rows: list[dict] | None) -> None:
        if t is not None and not t.future.cancelled():
            try:
                t.future.set_result(rows)
            except Exception:  # noqa: BLE001 - cancelled meanwhile (the executor is shutting down)
                pass

    # ------------------------------------------------------------------ session ends
    def _on_end(self, s: _Session) -> dict[str, Any] | None:
        with self._lock:
            if s.id not in self._sessions:  # the collector dropped it a moment ago: abandoned, not ended
                return None
            s.ended = True
            ticket = self._held.pop(s.id, None)
            if self.turn_discount is not None and self.export_style == "per_call":  # per_leaf: per token
                s.client.apply_reward_discount(float(self.turn_discount))
            rows = s.client.export_interactions(self.export_style)
            calls = sum(len(it.output_message.get("tool_calls") or []) for it in s.client.cache)
            for row in rows:
                row["tool_calls"] = calls
            n = len(s.client.cache)
            self._drop(s)  # the key is gone with it: nothing of this session can be exported again
            self.stats.ended += 1
            self.stats.empty += not rows
        self._resolve(ticket, rows or None)
        return {"session_id": s.id, "interaction_count": n}

    def _on_collected(self, s: _Session, why: str) -> None:
        with self._lock:
            ticket = self._held.pop(s.id, None)
            self.stats.abandoned += 1
        log.warning("online session %s dropped whole, none of it trained: %s", s.id, why)
        self._resolve(ticket, None)

    # ------------------------------------------------------------------ routes
    def _admin_routes(self, app: Any, h: SimpleNamespace) -> None:
        err, admin, body = h.err, h.admin, h.body

        @app.post("/rl/start_session")
        async def start(request: Request):
            if (r := admin(request)) is not None:
                return r
            b = await body(request)
            with self._lock:
                self._prune()
                if not self._tickets:
                    return err(429, "no capacity: the trainer's staleness gate admits no more sessions now "
                                    "(it opens as training consumes ended sessions); retry later")
                ticket = self._tickets.popleft()
                self._count += 1
                sid = f"{b.get('task_id', 'session')}-{self._count}"
                key = secrets.token_urlsafe(32)
                self._sessions[sid] = _Session(sid, key, self._new_client(sid))
                self._by_key[key] = sid
                self._held[sid] = ticket
                self.stats.opened += 1
            return {"session_id": sid, "api_key": key, "base_url": self.base_url,
                    "task": json.loads(json.dumps(ticket.data, default=str))}

        @app.get("/rl/gateway")
        async def status(request: Request):
            if (r := admin(request)) is not None:
                return r
            return self.counters()

        for path in ("/rl/grant_capacity", "/rl/export"):
            @app.post(path)
            async def refused(request: Request):
                if (r := admin(request)) is not None:
                    return r
                return err(403, f"{request.url.path} is the trainer's in online mode: it grants capacity "
                                "through its staleness gate and trains every ended session itself")

    def _new_client(self, sid: str) -> Any:
        from areal_cli.rollout.openai_client import ArealOpenAI

        return ArealOpenAI(self.engine, self.tokenizer, session_id=sid, **self.client_kwargs)


class GatewayServer(ProxyServer):
    """A served gateway plus its idle collector (``stop()`` ends both and removes the gateway file)."""

    file: str | None = None
    _stop_collector: threading.Event | None = None

    def stop(self) -> None:
        if self._stop_collector is not None:
            self._stop_collector.set()
        super().stop()
        if self.file:
            try:
                os.remove(self.file)
            except OSError:
                pass


def serve_gateway(gateway: OnlineGateway, host: str = "127.0.0.1", port: int = 0,
                  gateway_file: str | None = None) -> GatewayServer:
    """Serve ``gateway``; collect idle sessions every ``session_timeout_s / 4`` (at most every second);
    write ``{url, base_url, service_key}`` to ``gateway_file`` (mode 0600) for the service to read."""
    s = serve_proxy(gateway, host=host, port=port)
    srv = GatewayServer(s.proxy, s.address, s.server, s.thread)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{s.address.rsplit(':', 1)[1]}"
    gateway.base_url = f"{url}/v1"
    stop = threading.Event()
    every = min(1.0, gateway.session_timeout_s / 4)

    def collect() -> None:
        while not stop.wait(every):
            gateway.collect_idle()

    threading.Thread(target=collect, name="areal-gateway-collector", daemon=True).start()
    srv._stop_collector = stop
    if gateway_file:
        os.makedirs(os.path.dirname(os.path.abspath(gateway_file)), exist_ok=True)
        tmp = f"{gateway_file}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "base_url": gateway.base_url, "service_key": gateway.admin_key,
                       "pid": os.getpid(), "started": time.time()}, f)
        os.replace(tmp, gateway_file)
        srv.file = gateway_file
    print(f"[areal] online gateway at {url}: the service opens sessions with POST {url}/rl/start_session"
          + (f" (key in {gateway_file})" if gateway_file else ""), flush=True)
    return srv


__all__ = ["GATEWAY_FILE", "GatewayServer", "GatewayStats", "OnlineGateway", "serve_gateway"]
