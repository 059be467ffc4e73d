"""Sender side of weight sync (runs in the trainer; group rank 0 talks to the servers).

Both senders consume ``named_tensors``: an iterator of ``(name, full_tensor | None)`` that every
trainer rank drives in lockstep (gathering a sharded parameter is a collective); only the source
rank gets tensors and talks to servers. A failure on the source rank is recorded, the iteration is
still drained so the other ranks do not hang in a collective, and the error is returned for the
engine to re-raise on every rank.

Protocols (SGLang's, spoken by the built-in ``hf`` server too):

- disk: write ``<meta.path>/v<version>/`` (HF layout), then pause → ``update_weights_from_disk`` →
  continue.
- distributed: pause → ``begin_weight_update`` → (first time) ``init_weights_update_group`` on the
  servers while rank 0 joins the group as SGLang's helper builds it (``weight_sync/group.py``) → per
  bucket, ``update_weights_from_distributed`` (HTTP) concurrently with the broadcast → ``end_weight_update``
  (always, once begun: SGLang refuses a second begin while a session is open) → continue. A bucket
  is one broadcast per tensor, or with ``load_format="flattened_bucket"`` (SGLang and hf) one uint8
  broadcast of the tensors' bytes in request order, each at an offset aligned to its dtype.

  Servers that advertise ``supports_atomic_update`` (the built-in ``hf`` server) get no separate
  pause/continue calls: every bucket request asks the server to pause right before applying it and
  the last one to continue right after, so a one-bucket push is a single round trip, and the server
  keeps generating while the bucket is on the wire. The group is created once and reused by later
  pushes (the port of a later ``meta`` only matters when a new group must be made); any failure
  drops it, so the next push rebuilds it. A ``meta`` with another group name or server set (the
  trainer renames the group after a server restart) replaces it: every server joins the new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable, Iterator
from typing import Any

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta
from areal_cli.api.weight_receiver import WeightReceiver
from areal_cli.errors import WeightSyncError
from areal_cli.utils.concurrency import LoopRunner, torch_threads
from areal_cli.weight_sync.common import call_all, peer_names
from areal_cli.weight_sync.disk_layout import versioned_dir

NamedTensors = Iterator[tuple[str, Any]]


def _drain(it: NamedTensors) -> None:
    for _ in it:
        pass


def _broadcast_refused(clients: list[WeightReceiver]) -> WeightSyncError | None:
    """Servers whose backend cannot take a broadcast at all (``WEIGHT_BROADCAST_UNSUPPORTED``: vLLM)."""
    bad = [(peer_names(c), why) for c in clients if (why := c.broadcast_refusal)]
    if not bad:
        return None
    names = ", ".join(n for n, _ in bad)
    return WeightSyncError(f"weight sync (distributed): server(s) {names} cannot receive a broadcast: "
                           f"{bad[0][1]}")


class DiskSender:
    """Writes a versioned safetensors dir and asks every server to load it."""

    def __init__(self, runner: LoopRunner):
        self.runner = runner
        self.last_seconds: dict[str, float] = {}

    def send(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], named_tensors: NamedTensors, *,
             is_src: bool, write_dir: Callable[[str, NamedTensors], None]) -> WeightSyncError | None:
        """``write_dir(path, named_tensors)`` writes the HF dir (weights as they arrive, config, tokenizer) on
        the source rank; the other ranks drive the stream's gathers."""
        if not meta.path:
            _drain(named_tensors)
            return WeightSyncError("weight sync (disk): WeightUpdateMeta.path is empty — set the directory "
                                   "the servers can read (e.g. /dev/shm/areal/weights)")
        if not is_src:
            _drain(named_tensors)
            return None
        t0 = time.perf_counter()
        out = versioned_dir(meta.path, meta.version)
        try:
            write_dir(out, named_tensors)
        except OSError as e:
            _drain(named_tensors)
            return WeightSyncError(f"weight sync (disk): cannot write {out}: {e}")
        t2 = time.perf_counter()
        load_meta = dataclasses.replace(meta, path=out)
        try:
            self.runner.run(self._push(load_meta, clients))
        except WeightSyncError as e:
            return e
        t3 = time.perf_counter()
        # gather and write overlap (the dir is written as tensors arrive): "write" is both
        self.last_seconds = {"gather": 0.0, "write": t2 - t0, "load": t3 - t2, "total": t3 - t0}
        return None

    def close(self) -> None:
        """Nothing held between pushes (the distributed sender's group is)."""

    @staticmethod
    async def _push(meta: WeightUpdateMeta, clients: list[WeightReceiver]) -> None:
        to = meta.timeout_s
        await call_all(clients, lambda c: c.pause_generation(), timeout=to, what="pause_generation")
        try:
            await call_all(clients, lambda c: c.update_weights_from_disk(meta), timeout=to,
                           what="update_weights_from_disk")
        finally:
            await call_all(clients, lambda c: c.continue_generation(), timeout=to, what="continue_generation")


class _Bucket:
    """Tensors of one broadcast bucket as they go on the wire.

    Tensors are cast straight into a slot of a flat staging buffer (no temporary, no page faults
    after the first sync). Per-tensor mode sends a tensor that is already in wire dtype/device and
    contiguous as is (zero-copy); ``flat`` mode (``load_format="flattened_bucket"``) always stages
    into one uint8 buffer, so the bucket goes out as one broadcast."""

    def __init__(self, sender: "DistributedSender", parity: int, flat: bool):
        self.sender = sender
        self.parity = parity
        self.flat = flat
        self.names: list[str] = []
        self.tensors: list = []
        self.nbytes = 0
        self.fill: dict = {}  # dtype -> elements used in this bucket's staging buffer (first-use order)
        self.byte_fill = 0  # flat mode: bytes used in the uint8 staging buffer

    def aligned_for(self, dtype) -> bool:
        """Flat mode: whether a tensor of ``dtype`` can start at the current end (SGLang's receiver
        refuses a tensor at an offset that is not a multiple of its dtype's size)."""
        return not self.flat or self.byte_fill % dtype.itemsize == 0

    def add(self, name: str, t, dtype, bucket_bytes: int) -> None:
        import torch

        if self.flat:
            off, nb = self.byte_fill, t.numel() * dtype.itemsize
            buf = self.sender._staging(self.parity, torch.uint8, max(bucket_bytes, off + nb), keep=off)
            out = buf[off:off + nb].view(dtype).view(t.shape)
            out.copy_(t)
            self.byte_fill = off + nb
        elif t.dtype == dtype and t.device == torch.device(self.sender.device) \
                and t.is_contiguous():
            out = t
        else:
            off = self.fill.get(dtype, 0)
            cap = max(bucket_bytes // dtype.itemsize, off + t.numel())
            out = self.sender._staging(self.parity, dtype, cap, keep=off)[off:off + t.numel()].view(t.shape)
            out.copy_(t)
            self.fill[dtype] = off + t.numel()
        self.names.append(name)
        self.tensors.append(out)
        self.nbytes += t.numel() * dtype.itemsize

    def wire(self) -> list:
        """What to broadcast, in order: the flat per-dtype prefixes, or every tensor."""
        import torch

        if not self.flat:
            return list(self.tensors)
        return [self.sender._staging(self.parity, torch.uint8, self.byte_fill)[:self.byte_fill]]


class DistributedSender:
    """Bucketed broadcast from trainer rank 0 over a group shared with the servers.

    Pipelined: bucket k+1 is staged while bucket k is broadcast, and its request and broadcast start
    as soon as bucket k's broadcast is done — the server then copies bucket k into its model while
    receiving k+1. (Requests stay ordered: k+1 is sent only after the server has taken bucket k.)"""

    def __init__(self, runner: LoopRunner, device: str = "cpu", *, reuse_group: bool = True,
                 atomic: bool = True):
        """``reuse_group=False`` makes a new group whenever ``meta.master_port`` changes and
        ``atomic=False`` always sends explicit pause/continue calls: the earlier behaviour, kept as
        the baseline of ``benchmarks/weight_sync.py``."""
        self.runner = runner
        self.device = device
        self.reuse_group = reuse_group
        self.atomic = atomic
        self.pg = None
        self.store = None
        self._group_key: tuple | None = None
        self.last_seconds: dict[str, float] = {}
        self._phase: dict[str, float] = {}
        self._buffers: dict[tuple, object] = {}  # (parity, dtype) -> flat staging buffer
        self._pending = None  # concurrent.futures.Future: broadcast of the bucket in flight -> its reply future
        self._requests: list = []  # concurrent.futures.Futures of the update requests not yet answered
        self._open_pause = False  # a bucket asked the servers to pause and no later request resumed them

    # -- group ----------------------------------------------------------------------------------
    def _make_group(self, meta: WeightUpdateMeta):
        """Rank 0 of the group, hosting its store; the same steps as SGLang's receiver."""
        from areal_cli.weight_sync.group import make_group

        return None, make_group(meta.backend, meta.master_address, meta.master_port, meta.world_size, 0,
                                meta.group_name, meta.timeout_s)

    def _key(self, meta: WeightUpdateMeta, clients: list[WeightReceiver]) -> tuple:
        # The port only serves the rendezvous: an established group stays valid when a later meta
        # names another free port (the trainer picks a new one per push). The servers' addresses
        # are part of the key: a changed server set needs a new group.
        return (meta.master_address, meta.group_name, meta.world_size, meta.backend,
                tuple(peer_names(c) for c in clients), None if self.reuse_group else meta.master_port)

    def has_group(self, meta: WeightUpdateMeta, clients: list[WeightReceiver]) -> bool:
        return self.pg is not None and self._group_key == self._key(meta, clients)

    async def _ensure_group(self, meta: WeightUpdateMeta, clients: list[WeightReceiver]) -> None:
        key = self._key(meta, clients)
        if self.pg is not None and self._group_key == key:
            return
        if self.pg is not None:
            # Replaced (another server set or group name, e.g. after a server restart): release the old
            # group rather than keep it registered for the rest of the run. No work is pending on it:
            # a failed collective already dropped ``self.pg``.
            from areal_cli.weight_sync.group import destroy_group

            old, self.pg, self._group_key = self.pg, None, None
            destroy_group(old)
        loop = asyncio.get_running_loop()
        make = loop.run_in_executor(None, self._make_group, meta)
        join = asyncio.ensure_future(call_all(clients, lambda c: c.init_weights_update_group(meta),
                                              timeout=meta.timeout_s, what="init_weights_update_group"))
        # A server that refuses the join request (dead, restarting) can never join: fail now rather
        # than after the group timeout. The abandoned group creation times out in its thread.
        await asyncio.wait({make, join}, timeout=meta.timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        if join.done() and not join.cancelled() and join.exception() is not None and not make.done():
            make.add_done_callback(lambda f: f.exception())
            raise WeightSyncError(
                f"weight sync (distributed): server(s) {', '.join(peer_names(c) for c in clients)} could not "
                f"join group {meta.group_name!r}: {join.exception()}") from join.exception()
        if not make.done():
            join.cancel()
            make.add_done_callback(lambda f: f.exception())
            raise WeightSyncError(
                f"weight sync (distributed): server(s) {', '.join(peer_names(c) for c in clients)} did not join "
                f"group {meta.group_name!r} at {meta.master_address}:{meta.master_port} within "
                f"{meta.timeout_s:.1f}s")
        try:
            store, pg = make.result()
        except Exception as e:
            join.cancel()
            raise WeightSyncError(
                f"weight sync (distributed): group {meta.group_name!r} at {meta.master_address}:{meta.master_port} "
                f"with server(s) {', '.join(peer_names(c) for c in clients)} failed: {e}") from e
        await join
        self.store, self.pg, self._group_key = store, pg, key

    def _broadcast(self, tensors: list, meta: WeightUpdateMeta) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=meta.timeout_s)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timeout
        # A local reference: if the push gives up on this broadcast (``self.pg`` dropped), the group is
        # destroyed here when the broadcast ends, not in the caller (its destructor waits for
        # pending work, which would block the event loop until the group timeout).
        pg = self.pg
        for t in tensors:
            pg.broadcast([t], opts).wait(timeout)

    async def _send_bucket(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], bucket: _Bucket,
                           final: bool, atomic: bool) -> concurrent.futures.Future:
        """Request + broadcast of one bucket; returns a future of the request's reply once the
        broadcast is done (the server may still be copying the bucket in). ``atomic``: the request
        asks the servers to pause before applying it, and if ``final`` to continue after."""
        specs = [ParamSpec(n, str(t.dtype).replace("torch.", ""), list(t.shape))
                 for n, t in zip(bucket.names, bucket.tensors)]
        kw = {"flattened_bucket": True} if bucket.flat else {}  # the client sends load_format=flattened_bucket
        if atomic:
            kw.update(pause_generation=True, continue_generation=final)
            self._open_pause = self._open_pause or not final
        http = asyncio.ensure_future(call_all(
            clients, lambda c: c.update_weights_from_distributed(meta, specs, **kw), timeout=meta.timeout_s,
            what="update_weights_from_distributed"))
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        bcast = loop.run_in_executor(None, self._broadcast, bucket.wire(), meta)
        # A request that fails while the broadcast waits (server died, restarted without the group,
        # rejected before receiving) means the broadcast can never finish: fail now, not at the timeout.
        await asyncio.wait({bcast, http}, timeout=meta.timeout_s + 5, return_when=asyncio.FIRST_EXCEPTION)
        if not bcast.done() or bcast.exception() is not None:
            self.pg = None  # a failed collective leaves the group unusable; rebuild next time
            peers = ", ".join(peer_names(c) for c in clients)
            if http.done() and not http.cancelled() and http.exception() is not None:
                if not bcast.done():  # abandoned: it ends at the group timeout; keep its buffers out of reuse
                    bcast.add_done_callback(lambda f: f.exception())
                    self._buffers.clear()
                raise http.exception()  # the HTTP side knows which server failed
            http.cancel()
            e = bcast.exception() if bcast.done() else TimeoutError("no progress")
            raise WeightSyncError(f"weight sync (distributed): broadcast to server(s) {peers} failed or timed out "
                                  f"after {meta.timeout_s:.1f}s: {type(e).__name__}: {e}") from e
        t1 = time.perf_counter()
        self._phase["broadcast"] += t1 - t0
        self._phase["bcast_end"] = t1
        reply: concurrent.futures.Future = concurrent.futures.Future()

        def settle(f: asyncio.Future) -> None:  # the trainer thread waits on ``reply`` without a loop hop
            self._phase["last_reply"] = time.perf_counter()
            if f.cancelled():
                reply.set_exception(WeightSyncError("weight sync (distributed): update request cancelled"))
            elif f.exception() is not None:
                reply.set_exception(f.exception())
            else:
                reply.set_result(f.result())

        http.add_done_callback(settle)
        return reply

    # -- main -----------------------------------------------------------------------------------
    def send(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], named_tensors: NamedTensors, *,
             is_src: bool) -> WeightSyncError | None:
        with torch_threads(1) if is_src else contextlib.nullcontext():
            return self._send(meta, clients, named_tensors, is_src=is_src)

    def _send(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], named_tensors: NamedTensors, *,
              is_src: bool) -> WeightSyncError | None:
        import torch

        refused = _broadcast_refused(clients) if is_src else None
        if refused is not None:  # before any pause, session or group: nothing to undo
            _drain(named_tensors)  # the other ranks still gather (collectives)
            return refused
        wire = getattr(torch, meta.dtype) if meta.dtype else None
        flat = bool(clients) and all(c.supports_flattened_bucket for c in clients)
        atomic = self.atomic and bool(clients) and all(c.supports_atomic_update for c in clients)
        self._open_pause = False
        err: WeightSyncError | None = None
        t0 = time.perf_counter()
        tp = t0
        session: list = []  # clients whose weight-update session was opened (and must be closed)
        if is_src:
            try:
                if not atomic:
                    self.runner.run(call_all(clients, lambda c: c.pause_generation(), timeout=meta.timeout_s,
                                             what="pause_generation"))
                tp = time.perf_counter()
                session = list(clients)
                self.runner.run(call_all(session, lambda c: c.begin_weight_update(), timeout=meta.timeout_s,
                                         what="begin_weight_update"))
                if not self.has_group(meta, clients):  # checked here: no hop through the event loop
                    self.runner.run(self._ensure_group(meta, clients))
            except WeightSyncError as e:
                err = e
        t1 = time.perf_counter()
        self._phase = {"gather": 0.0, "stage": 0.0, "broadcast": 0.0}
        bucket = _Bucket(self, 0, flat)
        n_buckets = 0
        tg = time.perf_counter()
        for name, t in named_tensors:
            if not is_src or err is not None:
                continue
            self._phase["gather"] += time.perf_counter() - tg
            t = t.detach()
            dtype = wire if (wire is not None and t.is_floating_point()) else t.dtype
            nbytes = t.numel() * dtype.itemsize
            if bucket.names and (bucket.nbytes + nbytes > meta.bucket_bytes or not bucket.aligned_for(dtype)):
                err = self._flush(meta, clients, bucket, final=False, atomic=atomic)
                n_buckets += 1
                bucket = _Bucket(self, n_buckets % 2, flat)
                if err is not None:
                    continue
            ts = time.perf_counter()
            bucket.add(name, t, dtype, meta.bucket_bytes)
            tg = time.perf_counter()
            self._phase["stage"] += tg - ts
        if is_src and err is None and bucket.names:
            err = self._flush(meta, clients, bucket, final=True, atomic=atomic)
            n_buckets += 1
        if is_src:
            tb = time.perf_counter()
            err = self._wait_broadcast() or err
            tb = time.perf_counter() - tb
            err = self._wait_requests(0) or err
            last_reply = self._phase.pop("last_reply", time.perf_counter())
            bcast_end = self._phase.pop("bcast_end", last_reply)
            tc = time.perf_counter()
            if session:  # closed even after a failure: SGLang refuses to open a second one
                try:
                    self.runner.run(call_all(session, lambda c: c.end_weight_update(), timeout=meta.timeout_s,
                                             what="end_weight_update"))
                except WeightSyncError as e:
                    err = err or e
            # Atomic pushes resume in their last request; only a failure after a bucket that paused
            # the servers (and before the one that resumes them) leaves them paused.
            if not atomic or (err is not None and self._open_pause):
                try:
                    self.runner.run(call_all(clients, lambda c: c.continue_generation(), timeout=meta.timeout_s,
                                             what="continue_generation"))
                except WeightSyncError as e:
                    err = err or e
            if err is not None:
                self.pg = None  # e.g. a server left: the group may be unusable; rebuild next time
            t2 = time.perf_counter()
            self.last_seconds = {"pause": tp - t0, "group": t1 - tp, "pause_init": t1 - t0, "transfer": t2 - t1,
                                 "continue": t2 - tc, "total": t2 - t0, "buckets": float(n_buckets),
                                 "flattened": float(flat), "atomic": float(atomic), **self._phase,
                                 "wait_last_broadcast": tb, "server_tail": max(0.0, last_reply - bcast_end)}
        return err

    def _staging(self, parity: int, dtype, numel: int, keep: int = 0):
        """Flat wire buffer ``parity`` (0/1: the bucket being filled vs the one in flight) for
        ``dtype``, kept across syncs; ``torch.empty`` only reserves, pages are touched as filled.
        Growing it keeps its first ``keep`` elements (the part of the bucket already staged)."""
        import torch

        key = (parity, dtype)
        buf = self._buffers.get(key)
        dev = torch.device(self.device)
        if buf is None or buf.numel() < numel or buf.device != dev:
            old = self._buffers.pop(key, None)
            buf = torch.empty(numel, dtype=dtype, device=dev)
            if old is not None and keep:
                buf[:keep].copy_(old[:keep])
            self._buffers[key] = buf
        return buf

    def _flush(self, meta, clients, bucket: _Bucket, *, final: bool, atomic: bool) -> WeightSyncError | None:
        """Start sending ``bucket`` once the previous bucket's broadcast is done (its staging buffer
        is then free for the bucket after this one) and at most one earlier request is unanswered."""
        err = self._wait_broadcast() or self._wait_requests(1)
        if err is not None:
            return err
        self._pending = asyncio.run_coroutine_threadsafe(self._send_bucket(meta, clients, bucket, final, atomic),
                                                         self.runner.loop)
        return None

    def _wait_broadcast(self) -> WeightSyncError | None:
        fut, self._pending = self._pending, None
        if fut is None:
            return None
        try:
            self._requests.append(fut.result())
        except WeightSyncError as e:
            return e
        except Exception as e:  # anything unexpected still must not hang or go unnamed
            return WeightSyncError(f"weight sync (distributed): bucket send failed: {type(e).__name__}: {e}")
        return None

    def _wait_requests(self, keep: int) -> WeightSyncError | None:
        """Wait until at most ``keep`` update requests are unanswered; the first failure wins."""
        err = None
        while len(self._requests) > keep:
            reply = self._requests.pop(0)
            try:
                reply.result()
            except WeightSyncError as e:
                err = err or e
            except Exception as e:
                err = err or WeightSyncError(f"weight sync (distributed): update request failed: "
                                             f"{type(e).__name__}: {e}")
        return err

    def close(self) -> None:
        from areal_cli.weight_sync.group import destroy_group

        if self.pg is not None:
            destroy_group(self.pg)
        self.pg = None
        self.store = None
        self._buffers.clear()
