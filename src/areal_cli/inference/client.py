"""One HTTP client for every inference backend (``hf``, ``sglang``, ``vllm``).

- transport: an ``aiohttp.ClientSession`` (one per event loop: the rollout executor's loop and the
  trainer's ``asyncio.run`` calls each get their own; aiohttp rather than httpx because its C HTTP
  parser costs about a fifth of httpx's CPU per request, and the client runs inside the
  trainer's rank-0 process), per-call timeouts, retries with exponential backoff on
  connection errors, timeouts and 5xx; 4xx are the caller's fault and raise at once;
- routing: ``least_loaded`` (fewest in-flight requests, ties round-robin) or ``round_robin``; a server
  that refuses connections leaves the routing set and the request is retried elsewhere; it comes
  back after a successful health probe (:meth:`check_health`, run automatically every
  ``health_interval_s`` and whenever no healthy server is left);
- session affinity: a request with a ``session_id`` (an agent session, a GRPO group) goes to the
  server that served that id before while it is healthy and not failing this request, so the
  server's prefix cache holds the session's earlier turns; otherwise the routing above picks one
  and the id follows it. Ids are forgotten by :meth:`end_session` or, least recently used first,
  past ``AFFINITY_KEYS``;
- resume: a generation that ends with ``abort`` (a weight update paused the server) is re-submitted
  as prompt + tokens so far with the remaining budget; tokens, logprobs and per-token versions are
  concatenated, so a response may span policy versions and ends only with ``stop`` or ``length``.

Distributed weight updates are collectives: the trainer must create its own group rank 0 (and
broadcast its tensors) *while* :meth:`init_weights_update_group` / :meth:`update_weights_from_distributed`
are awaiting the servers, e.g. ``await asyncio.gather(engine.init_weights_update_group(meta),
asyncio.to_thread(make_rank0_group))``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import aiohttp

from areal_cli.api.inference_api import InferenceEngine
from areal_cli.api.io_struct import GenerationConfig, ModelRequest, ModelResponse, ParamSpec, WeightUpdateMeta
from areal_cli.config.rollout import ROUTINGS
from areal_cli.errors import InferenceError
from areal_cli.inference.backends import get_backend
from areal_cli.inference.backends.base import HttpCall, Segment

KEEPALIVE_S = 3.0  # below the servers' keep-alive (uvicorn's default 5 s; see _client)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _text(content: bytes) -> str:
    return content.decode("utf-8", errors="replace")


async def _close_on_shutdown(session: aiohttp.ClientSession) -> Any:
    try:
        yield
    finally:
        await session.close()


class RequestRejected(InferenceError):
    """A 4xx answer: the request itself is wrong, retrying elsewhere will not help."""

    def __init__(self, message: str, status: int = 400, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body

    @property
    def server_message(self) -> str:
        """The server's own words (``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}`` or the raw
        body): what an OpenAI-shaped route hands on to its caller with the same status."""
        try:
            data = json.loads(self.body)
        except ValueError:
            return self.body.strip() or str(self)
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return err["message"]
            for k in ("message", "detail", "error"):
                if isinstance(data.get(k), str):
                    return data[k]
        return self.body.strip() or str(self)


class _Unreachable(InferenceError):
    """Connection refused/reset: the server is down."""


@dataclass
class _ServerState:
    address: str
    inflight: int = 0
    healthy: bool = True
    failures: int = 0
    model_name: str | None = None  # vLLM needs the served model name in every request


@dataclass
class _Partial:
    """One request of :meth:`RemoteInferenceEngine.agenerate_group` while it is being generated."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cutoffs: list[float] | None = None  # Keep-Sampling-Mask, when asked for
    routing: Any = None  # routing replay, when asked for: [positions so far, n_layers * top_k]
    resumes: int = 0
    ttft: float = 0.0
    stop: str | None = None
    prompt: list[int] | None = None  # the prompt as the model saw it (image pads expanded), when reported


def _stitch_routing(have: Any, seg: Segment, backend: str) -> Any:
    """A request's routed experts after one more segment: every segment covers its whole input (the
    prompt plus the tokens of earlier segments), and a position keeps its first recording."""
    if seg.routed_experts is None:
        raise InferenceError(f"return_routed_experts: the {backend} server returned no routed_experts "
                             "(the hf server records them for MoE models; SGLang with "
                             "--enable-return-routed-experts)")
    from areal_cli.engines.routing_replay import stitch

    return stitch(have, seg.routed_experts)


def _url(address: str, path: str) -> str:
    base = address if address.startswith(("http://", "https://")) else f"http://{address}"
    return base.rstrip("/") + path


class RemoteInferenceEngine(InferenceEngine):
    """Client for one or more servers of one backend (see module docstring)."""

    AFFINITY_KEYS = 65536  # session ids remembered (about 200 bytes each)

    def __init__(self, addresses: list[str], backend: str = "hf", *, timeout_s: float = 300.0,
                 retries: int = 3, routing: str = "least_loaded", api_key: str | None = None,
                 backoff_s: float = 0.5, health_interval_s: float = 5.0, max_resumes: int = 1000,
                 admin_timeout_s: float = 600.0, flattened_bucket: bool = True, atomic_update: bool = True,
                 tp_sizes: list[int] | int = 1, lora_name: str | None = None):
        """``tp_sizes``: tensor-parallel size of each server (one int: all the same). Every TP rank of
        an SGLang server joins the weight-update group, so it sets the group's ranks and size."""
        if routing not in ROUTINGS:
            raise InferenceError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if not addresses:
            raise InferenceError("RemoteInferenceEngine needs at least one server address")
        self.backend_name = backend
        self.backend = get_backend(backend)
        self.allow_flattened_bucket = flattened_bucket  # False: SGLang's per-tensor wire protocol
        self.allow_atomic_update = atomic_update  # False: explicit pause/continue calls around a push
        self.timeout_s = timeout_s
        self.admin_timeout_s = admin_timeout_s
        self.retries = max(0, retries)
        self.routing = routing
        self.api_key = api_key
        self.backoff_s = backoff_s
        self.health_interval_s = health_interval_s
        self.max_resumes = max_resumes
        self._servers: dict[str, _ServerState] = {a: _ServerState(a) for a in addresses}
        self._order: list[str] = list(addresses)
        self._tp = self._tp_list(tp_sizes, len(addresses))
        self._checked_versions: set[str] = set()
        self._rr = itertools.count()
        self._affinity: collections.OrderedDict[str, str] = collections.OrderedDict()  # session id -> address
        self._version = 0
        self._clients: dict[int, aiohttp.ClientSession] = {}
        self._keepers: dict[int, Any] = {}
        self._last_health = time.monotonic()
        # LoRA: every generation request names this adapter (SGLang's lora_path, vLLM's model).
        self.lora_name = lora_name
        self._lora_loaded: set[str] = set()  # servers this client loaded an adapter version into

    # ------------------------------------------------------------------ addresses / routing
    @property
    def addresses(self) -> list[str]:
        return list(self._order)

    @staticmethod
    def _tp_list(tp_sizes: list[int] | int, n: int) -> list[int]:
        tps = [int(tp_sizes)] * n if isinstance(tp_sizes, int) else [int(t) for t in tp_sizes]
        if len(tps) != n or any(t < 1 for t in tps):
            raise InferenceError(f"tp_sizes={tp_sizes!r} must be one positive size per server ({n} servers)")
        return tps

    @property
    def weight_group_world_size(self) -> int:
        """World size of the weight-update group: the trainer plus every TP rank of every server."""
        return self.backend.group_ranks(self._tp)[1]

    def set_addresses(self, addresses: list[str]) -> None:
        """Replace the server set (e.g. after the launcher restarted one); new ones start healthy."""
        if not addresses:
            raise InferenceError("set_addresses needs at least one address")
        if len(addresses) != len(self._order):
            self._tp = self._tp_list(self._tp[0] if len(set(self._tp)) == 1 else 1, len(addresses))
        self._servers = {a: self._servers.get(a) or _ServerState(a) for a in addresses}
        for s in self._servers.values():
            s.healthy, s.failures = True, 0
        self._order = list(addresses)

    def healthy_addresses(self) -> list[str]:
        return [a for a in self._order if self._servers[a].healthy]

    def _pick(self, exclude: set[str], key: str | None = None) -> _ServerState | None:
        if key is not None:
            s = self._servers.get(self._affinity.get(key, ""))
            if s is not None and s.healthy and s.address not in exclude:
                self._affinity.move_to_end(key)
                return s
        cands = [self._servers[a] for a in self._order if self._servers[a].healthy and a not in exclude]
        if not cands:
            cands = [self._servers[a] for a in self._order if self._servers[a].healthy]
        if not cands:
            return None
        start = next(self._rr) % len(cands)
        rotated = cands[start:] + cands[:start]
        s = rotated[0] if self.routing == "round_robin" else min(rotated, key=lambda s: s.inflight)
        if key is not None:
            self._affinity[key] = s.address
            self._affinity.move_to_end(key)
            while len(self._affinity) > self.AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return s

    def end_session(self, key: str) -> None:
        """Forget a session id's server (its episode is over)."""
        self._affinity.pop(key, None)

    def session_server(self, key: str) -> str | None:
        """The server a session id is routed to (None: not routed yet, or forgotten)."""
        return self._affinity.get(key)

    # ------------------------------------------------------------------ transport
    async def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        key = id(loop)
        c = self._clients.get(key)
        if c is None or c.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # Idle connections are dropped after KEEPALIVE_S, before the server drops them: SGLang and vLLM
            # serve with uvicorn's 5 s keep-alive, and a request written to a connection the server is
            # closing fails ("Can not write request body", "Server disconnected") and marks a healthy
            # server unreachable.
            c = aiohttp.ClientSession(headers=headers, json_serialize=_dumps, connector=aiohttp.TCPConnector(
                limit=1024, keepalive_timeout=KEEPALIVE_S))
            self._clients[key] = c
            # Closed when its loop shuts down (asyncio.run and the executor's loop both finalise
            # async generators), so callers of short-lived loops need not call close().
            keeper = _close_on_shutdown(c)
            await keeper.__anext__()
            self._keepers[key] = keeper
        return c

    async def _send(self, address: str, call: HttpCall, timeout: float) -> Any:
        """One HTTP exchange. Raises _Unreachable, RequestRejected (4xx) or InferenceError (5xx/timeout)."""
        params = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in call.params.items()} \
            if call.params else None  # query strings as httpx wrote them (True -> "true")
        try:
            async with (await self._client()).request(call.method, _url(address, call.path), json=call.json,
                                              params=params, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                status, content = r.status, await r.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            if isinstance(e, aiohttp.ServerTimeoutError):
                raise InferenceError(f"{address}{call.path} timed out after {timeout:.0f}s "
                                     f"({type(e).__name__})") from None
            raise _Unreachable(f"{address} unreachable: {type(e).__name__}: {e}") from None
        except asyncio.TimeoutError as e:
            raise InferenceError(f"{address}{call.path} timed out after {timeout:.0f}s ({type(e).__name__})") from None
        if 400 <= status < 500:
            body = _text(content)[:500]
            raise RequestRejected(f"{address}{call.path} rejected the request ({status}): {body}", status, body)
        if status >= 500:
            raise InferenceError(f"{address}{call.path} failed ({status}): {_text(content)[:500]}")
        if not content:
            return None
        try:
            return json.loads(content)
        except ValueError:
            return _text(content)

    async def _send_retry(self, address: str, call: HttpCall, timeout: float, retries: int | None = None) -> Any:
        """Same server, retries with backoff (admin calls that must reach *this* server)."""
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return await self._send(address, call, timeout)
            except RequestRejected:
                raise
            except InferenceError:
                if attempt == retries:
                    raise
                await asyncio.sleep(self.backoff_s * (2 ** attempt) * (1 + 0.1 * random.random()))
        raise AssertionError("unreachable")

    async def check_health(self) -> dict[str, bool]:
        """Probe every server; healthy ones (re)join routing."""
        async def probe(s: _ServerState) -> None:
            try:
                await self._send(s.address, self.backend.HEALTH, timeout=5.0)
                s.healthy, s.failures = True, 0
            except InferenceError:
                s.healthy = False

        await asyncio.gather(*[probe(s) for s in self._servers.values()])
        self._last_health = time.monotonic()
        return {a: self._servers[a].healthy for a in self._order}

    async def close(self) -> None:
        key = id(asyncio.get_running_loop())
        c = self._clients.pop(key, None)
        self._keepers.pop(key, None)
        if c is not None:
            await c.close()

    # ------------------------------------------------------------------ generation
    async def _model_name(self, s: _ServerState) -> str:
        if s.model_name is None:
            resp = await self._send_retry(s.address, self.backend.build_models(), timeout=30.0)
            s.model_name = self.backend.parse_model_name(resp)
        return s.model_name

    async def _route(self, build: Callable[[_ServerState], Awaitable[HttpCall]], parse: Callable[[Any], T],
                     rows: int = 1, key: str | None = None) -> tuple[T, str]:
        """One generation call with failover: ``build(server)`` makes the call, ``parse`` reads the
        answer; ``rows`` sequences count toward the server's in-flight load; ``key``: the session id
        (affinity). Returns (parsed, address)."""
        tried: set[str] = set()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if time.monotonic() - self._last_health > self.health_interval_s or not self.healthy_addresses():
                await self.check_health()
            s = self._pick(tried, key)
            if s is None:
                last = InferenceError(f"no healthy inference server among {self._order}")
                await asyncio.sleep(self.backoff_s * (2 ** attempt))
                continue
            call = await build(s)
            s.inflight += rows
            try:
                return parse(await self._send_through_swaps(s.address, call)), s.address
            except RequestRejected:
                raise
            except _Unreachable as e:
                s.healthy = False
                s.failures += 1
                log.warning("server %s unreachable; routing around it: %s", s.address, e)
                last = e
            except InferenceError as e:
                s.failures += 1
                last = e
                await asyncio.sleep(self.backoff_s * (2 ** attempt) * (1 + 0.1 * random.random()))
            finally:
                s.inflight -= rows
            tried.add(s.address)
        raise InferenceError(f"generation failed after {self.retries + 1} attempt(s): {last}")

    async def _send_through_swaps(self, address: str, call: HttpCall) -> Any:
        """``_send`` for generation calls, waiting out a backend's brief refusals that are not the
        request's fault: vLLM answers 404 for the LoRA adapter's name between the unload and the load of
        a runtime adapter swap (backend ``is_transient_rejection``). Bounded by the request timeout."""
        transient = self.backend.is_transient_rejection
        deadline = time.monotonic() + self.timeout_s
        wait = 0.05
        while True:
            try:
                return await self._send(address, call, self.timeout_s)
            except RequestRejected as e:
                if not transient(e.status, e.body) or time.monotonic() + wait > deadline:
                    raise
            await asyncio.sleep(wait)
            wait = min(2.0, wait * 2)

    async def _one_call(self, inputs: list[list[int]], gs: list[GenerationConfig], budgets: list[int],
                        images: list[list[str] | None], key: str | None = None,
                        pad_id: int | None = None) -> tuple[list[Segment], str]:
        """One prompt, one ``/generate`` call with failover."""
        async def build(s: _ServerState) -> HttpCall:
            kw: dict[str, Any] = {"max_new_tokens": budgets[0], "lora": self.lora_name}
            if images[0]:  # only then: a backend without images keeps its signature
                kw["image_data"] = images[0]
                if self.backend.ONE_PAD_PER_IMAGE:
                    kw["image_pad_id"] = pad_id
            if self.backend.NEEDS_MODEL_NAME and self.lora_name is None:  # an adapter is served by its name
                kw["model"] = await self._model_name(s)
            return self.backend.build_generate(inputs[0], gs[0], **kw)

        seg, address = await self._route(build, lambda resp: self.backend.parse_generate(
            resp, fallback_version=self._version), key=key)
        return [seg], address

    async def _batch_call(self, inputs: list[list[int]], gs: list[GenerationConfig], budgets: list[int],
                          images: list[list[str] | None], key: str | None = None,
                          pad_id: int | None = None) -> tuple[list[Segment], str]:
        """Several prompts in one ``/generate`` call (SGLang's batch form) with failover."""
        kw: dict[str, Any] = {"image_data": images} if any(images) else {}
        if kw and self.backend.ONE_PAD_PER_IMAGE:
            kw["image_pad_id"] = pad_id

        async def build(_s: _ServerState) -> HttpCall:
            return self.backend.build_generate_batch(inputs, gs, budgets, lora=self.lora_name, **kw)

        return await self._route(build, lambda resp: self.backend.parse_generate_batch(
            resp, len(inputs), fallback_version=self._version), rows=len(inputs), key=key)

    async def _rounds(self, reqs: list[ModelRequest], call: Callable[..., Awaitable[tuple[list[Segment], str]]]
                      ) -> list[ModelResponse]:
        """Generate ``reqs`` in rounds of ``call(inputs, gconfigs, budgets, images)``: rows that end with
        ``abort`` (a weight update paused the server) go again as prompt + tokens so far with the
        remaining budget, so a response may span versions and ends only with ``stop`` or ``length``."""
        t0 = time.monotonic()
        outs = [_Partial() for _ in reqs]
        address = ""
        while True:
            for r, o in zip(reqs, outs):
                if o.stop is None and r.gconfig.max_new_tokens - len(o.tokens) <= 0:
                    o.stop = "length"
            active = [i for i, o in enumerate(outs) if o.stop is None]
            if not active:
                break
            # A resumed image prompt goes again as the server expanded it (it keeps exact-length pad runs)
            inputs = [list(outs[i].prompt or reqs[i].input_ids) + outs[i].tokens for i in active]
            gs = [reqs[i].gconfig.new(min_new_tokens=max(0, reqs[i].gconfig.min_new_tokens - len(outs[i].tokens)))
                  for i in active]
            budgets = [reqs[i].gconfig.max_new_tokens - len(outs[i].tokens) for i in active]
            segs, address = await call(inputs, gs, budgets, [reqs[i].image_data for i in active])
            for i, seg in zip(active, segs):
                o = outs[i]
                if seg.prompt_ids is not None and o.prompt is None:
                    o.prompt = list(seg.prompt_ids)
                if seg.output_tokens and not o.tokens:
                    o.ttft = time.monotonic() - t0
                o.tokens += seg.output_tokens
                if reqs[i].gconfig.keep_sampling_mask:
                    if seg.sampling_cutoffs is None or seg.sampling_logprobs is None:
                        raise InferenceError(f"keep_sampling_mask: the {self.backend_name} server returned no "
                                             "sampling mask (only the hf server records it)")
                    o.cutoffs = (o.cutoffs or []) + seg.sampling_cutoffs
                    o.logprobs += seg.sampling_logprobs  # the behaviour policy is the truncated one
                else:
                    o.logprobs += seg.output_logprobs
                o.versions += seg.output_versions
                if reqs[i].gconfig.return_routed_experts:
                    o.routing = _stitch_routing(o.routing, seg, self.backend_name)
                if seg.finish != "abort":
                    o.stop = seg.finish
                    continue
                o.resumes += 1
                if o.resumes > self.max_resumes:
                    raise InferenceError(f"request {reqs[i].rid} was aborted {o.resumes} times; giving up")
        latency = time.monotonic() - t0
        return [ModelResponse(input_tokens=list(o.prompt or r.input_ids), output_tokens=o.tokens, output_logprobs=o.logprobs,
                              output_versions=o.versions, stop_reason=o.stop,  # type: ignore[arg-type]
                              latency=latency, ttft=o.ttft, n_resumes=o.resumes, server=address,
                              sampling_cutoffs=o.cutoffs, routed_experts=o.routing)
                for r, o in zip(reqs, outs)]

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return (await self._rounds([req], functools.partial(self._one_call, key=req.session_id,
                                                            pad_id=req.image_pad_id)))[0]

    @property
    def supports_batch_generate(self) -> bool:
        """Whether the backend takes several prompts in one ``/generate`` call (SGLang's batch form)."""
        return self.backend.SUPPORTS_BATCH_GENERATE

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """:meth:`agenerate` for several requests; with a batching backend, one HTTP call per round
        for all of them (a GRPO group: one call instead of ``group_size``), rows that a weight update
        aborted resumed together in the next round. Same per-request results and semantics."""
        if len(reqs) <= 1 or not self.supports_batch_generate:
            return list(await asyncio.gather(*(self.agenerate(r) for r in reqs)))
        key = next((r.session_id for r in reqs if r.session_id is not None), None)
        pad = next((r.image_pad_id for r in reqs if r.image_pad_id is not None), None)  # one model: one id
        return await self._rounds(reqs, functools.partial(self._batch_call, key=key, pad_id=pad))

    # ------------------------------------------------------------------ admin (every server)
    async def _all(self, calls: list[HttpCall | list[HttpCall]], what: str, *,
                   skip_unreachable: bool = False, retries: int | None = None) -> list[Any]:
        async def one(addr: str, c: HttpCall | list[HttpCall]) -> Any:
            out = None
            for step in (c if isinstance(c, list) else [c]):
                out = await self._send_retry(addr, step, self.admin_timeout_s, retries)
                self.backend.check_ok(out, f"{what} on {addr}")
            return out

        addrs = list(self._order)
        results = await asyncio.gather(*[one(a, c) for a, c in zip(addrs, calls)], return_exceptions=True)
        errors = []
        for a, r in zip(addrs, results):
            if isinstance(r, _Unreachable) and skip_unreachable:
                self._servers[a].healthy = False
                log.warning("%s: %s is down; skipped", what, a)
            elif isinstance(r, BaseException):
                errors.append(f"{a}: {r}")
        if errors:
            raise InferenceError(f"{what} failed on {len(errors)} server(s): " + "; ".join(errors))
        return list(results)

    async def pause_generation(self) -> None:
        await self._all([self.backend.build_pause() for _ in self._order], "pause_generation",
                        skip_unreachable=True)

    async def continue_generation(self) -> None:
        await self._all([self.backend.build_continue() for _ in self._order], "continue_generation",
                        skip_unreachable=True)

    async def update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        await self._all([self.backend.build_update_from_disk(meta) for _ in self._order],
                        "update_weights_from_disk")
        self._version = meta.version

    async def load_lora_adapter(self, name: str, path: str, version: int) -> None:
        """Load adapter version ``version`` from the peft dir ``path`` under ``name`` on every server
        (replacing the one loaded before; generation is paused around it where the server needs that)."""
        await self._all([self.backend.build_load_lora(name, path, version, loaded=a in self._lora_loaded)
                         for a in self._order], "load_lora_adapter")
        self._lora_loaded.update(self._order)
        self._version = version

    @property
    def supports_lora_broadcast(self) -> bool:
        """Whether the servers take an adapter over the weight-update group (hf only)."""
        return self.backend.SUPPORTS_LORA_BROADCAST

    async def load_lora_adapter_from_distributed(self, meta: WeightUpdateMeta, name: str, config: dict,
                                                 specs: list[ParamSpec]) -> None:
        if not self.supports_lora_broadcast:
            raise InferenceError(f"backend {self.backend.NAME!r} loads adapters from a directory only")
        calls = [self.backend.build_load_lora_distributed(meta, name, config, specs) for _ in self._order]
        await self._all(calls, "load_lora_adapter_from_distributed", retries=0)
        self._lora_loaded.update(self._order)
        self._version = meta.version

    async def check_server_versions(self) -> dict[str, str]:
        """SGLang only: read every server's version (``/server_info``) once and refuse one outside
        the supported range (``backends.sglang.SUPPORTED_VERSIONS``)."""
        info = self.backend.build_server_info()  # None: the backend has no version range to check
        todo = [a for a in self._order if a not in self._checked_versions]
        if info is None or not todo:
            return {}
        res = await asyncio.gather(*(self._send_retry(a, info, 30.0) for a in todo))
        out = {a: self.backend.check_server_version(r, a) for a, r in zip(todo, res)}
        self._checked_versions.update(todo)
        return out

    async def begin_weight_update(self) -> None:
        """Open the weight-update session SGLang requires around distributed/disk updates."""
        await self.check_server_versions()
        # vLLM's is an empty list of calls: it opens its own session in each update call.
        await self._all([self.backend.build_begin_update() for _ in self._order], "begin_weight_update")

    async def end_weight_update(self) -> None:
        await self._all([self.backend.build_end_update() for _ in self._order], "end_weight_update")

    async def release_memory_occupation(self) -> None:
        """Free the servers' accelerator memory for a colocated trainer (SGLang ``--enable-memory-saver``)."""
        await self._all([self.backend.build_release_memory() for _ in self._order], "release_memory_occupation")

    async def resume_memory_occupation(self) -> None:
        await self._all([self.backend.build_resume_memory() for _ in self._order], "resume_memory_occupation")

    async def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        offsets, world = self.backend.group_ranks(self._tp)
        if meta.world_size != world:
            raise InferenceError(f"WeightUpdateMeta.world_size={meta.world_size} but the {len(self._order)} "
                                 f"server(s) have TP sizes {self._tp}; it must be 1 + their sum = {world}")
        await self.check_server_versions()
        # Collectives are never resent: a second request would wait for peers that already moved on.
        await self._all([self.backend.build_init_group(meta, off) for off in offsets],
                        "init_weights_update_group", retries=0)

    @property
    def supports_flattened_bucket(self) -> bool:
        """Whether the backend takes ``load_format="flattened_bucket"`` (SGLang and hf; not vLLM)."""
        return self.allow_flattened_bucket and self.backend.SUPPORTS_FLATTENED_BUCKET

    @property
    def broadcast_refusal(self) -> str | None:
        """Why this backend's servers cannot receive a broadcast at all (vLLM), else None."""
        return getattr(self.backend, "WEIGHT_BROADCAST_UNSUPPORTED", None)

    @property
    def supports_atomic_update(self) -> bool:
        """Whether the backend pauses and continues generation itself around an update request
        (``pause_generation``/``continue_generation`` fields, hf only). SGLang and vLLM need the
        explicit :meth:`pause_generation` / :meth:`continue_generation` calls."""
        return self.allow_atomic_update and self.backend.SUPPORTS_ATOMIC_UPDATE

    async def update_weights_from_distributed(self, meta: WeightUpdateMeta, specs: list[ParamSpec], *,
                                              flattened_bucket: bool = False, pause_generation: bool = False,
                                              continue_generation: bool = False) -> None:
        """``flattened_bucket``: the trainer broadcasts the bucket as one uint8 buffer (SGLang's
        ``load_format="flattened_bucket"``); only allowed when :attr:`supports_flattened_bucket`.
        ``pause_generation`` / ``continue_generation``: the server pauses right before applying this
        bucket and/or continues right after it, at one token boundary (hf extension); only allowed
        when :attr:`supports_atomic_update`."""
        if flattened_bucket and not self.supports_flattened_bucket:
            raise InferenceError(f"backend {self.backend.NAME!r} does not take flattened_bucket weight updates; "
                                 "it takes one broadcast per tensor")
        if (pause_generation or continue_generation) and not self.supports_atomic_update:
            raise InferenceError("pause_generation/continue_generation inside a weight update are an hf-server "
                                 f"extension; backend {self.backend.NAME!r} needs explicit pause/continue calls")
        kw = {k: True for k, v in (("flattened_bucket", flattened_bucket), ("pause_generation", pause_generation),
                                   ("continue_generation", continue_generation)) if v}
        await self._all([self.backend.build_update_distributed(meta, specs, **kw) for _ in self._order],
                        "update_weights_from_distributed", retries=0)
        self._version = meta.version

    async def get_server_versions(self) -> dict[str, int | None]:
        res = await self._all([self.backend.build_get_version() for _ in self._order], "get_weight_version")
        return {a: self.backend.parse_version(r or {}) for a, r in zip(self._order, res)}

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)

    # ------------------------------------------------------------------ sync helper
    @staticmethod
    def run_sync(coro: Coroutine[Any, Any, T]) -> T:
        """Run one of the coroutines above from synchronous code (no loop running in this thread)."""
        return asyncio.run(coro)
