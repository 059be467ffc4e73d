"""Sender side of weight sync (runs in the trainer; group rank 0 talks to the servers).

Both senders consume ``named_tensors``: an iterator of ``(name, full_tensor | None)`` that every
trainer rank drives in lockstep (gathering a sharded parameter is a collective); only the source
rank gets tensors and talks to servers. A failure on the source rank is recorded, the iteration is
still drained so the other ranks do not hang in a collective, and the error is returned for the
engine to re-raise on every rank.

Protocols (SGLang's, spoken by the built-in ``hf`` server too):

- disk: write ``<meta.path>/v<version>/`` (HF layout), then pause → ``update_weights_from_disk`` →
  continue.
- distributed: pause → (first time) ``init_weights_update_group`` on the servers while rank 0
  creates the TCPStore master + process group → per bucket, ``update_weights_from_distributed``
  (HTTP) concurrently with one ``broadcast`` per tensor → continue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta
from areal_cli.errors import WeightSyncError
from areal_cli.weight_sync.common import LoopRunner, call_all, peer_names

NamedTensors = Iterator[tuple[str, Any]]


def versioned_dir(root: str, version: int) -> str:
    return str(Path(root) / f"v{version}")


def _drain(it: NamedTensors) -> None:
    for _ in it:
        pass


class DiskSender:
    """Writes a versioned safetensors dir and asks every server to load it."""

    def __init__(self, runner: LoopRunner):
        self.runner = runner
        self.last_seconds: dict[str, float] = {}

    def send(self, meta: WeightUpdateMeta, clients: list, named_tensors: NamedTensors, *, is_src: bool,
             write_dir: Callable[[str, dict], None]) -> WeightSyncError | None:
        """``write_dir(path, tensors)`` writes the HF dir (config, tokenizer) on the source rank."""
        if not meta.path:
            _drain(named_tensors)
            return WeightSyncError("weight sync (disk): WeightUpdateMeta.path is empty — set the directory "
                                   "the servers can read (e.g. /dev/shm/areal/weights)")
        t0 = time.perf_counter()
        tensors = {name: t for name, t in named_tensors if is_src}
        if not is_src:
            return None
        t1 = time.perf_counter()
        out = versioned_dir(meta.path, meta.version)
        try:
            write_dir(out, tensors)
        except OSError as e:
            return WeightSyncError(f"weight sync (disk): cannot write {out}: {e}")
        del tensors
        t2 = time.perf_counter()
        load_meta = dataclasses.replace(meta, path=out)
        try:
            self.runner.run(self._push(load_meta, clients))
        except WeightSyncError as e:
            return e
        t3 = time.perf_counter()
        self.last_seconds = {"gather": t1 - t0, "write": t2 - t1, "load": t3 - t2, "total": t3 - t0}
        return None

    @staticmethod
    async def _push(meta: WeightUpdateMeta, clients: list) -> None:
        to = meta.timeout_s
        await call_all(clients, "pause_generation", timeout=to)
        try:
            await call_all(clients, "update_weights_from_disk", meta, timeout=to)
        finally:
            await call_all(clients, "continue_generation", timeout=to)


class DistributedSender:
    """Bucketed broadcast from trainer rank 0 over a group shared with the servers."""

    def __init__(self, runner: LoopRunner, device: str = "cpu"):
        self.runner = runner
        self.device = device
        self.pg = None
        self.store = None
        self._group_key: tuple | None = None
        self.last_seconds: dict[str, float] = {}
        self._phase: dict[str, float] = {"broadcast": 0.0, "server_apply": 0.0}
        self._buffers: dict[str, object] = {}
        self._pending = None  # concurrent.futures.Future of the bucket in flight

    # -- group ----------------------------------------------------------------------------------
    def _make_group(self, meta: WeightUpdateMeta):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=meta.timeout_s)
        store = dist.TCPStore(meta.master_address, meta.master_port, meta.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        prefix = dist.PrefixStore(meta.group_name, store)
        if meta.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, 0, meta.world_size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, 0, meta.world_size, timeout)
        return store, pg

    async def _ensure_group(self, meta: WeightUpdateMeta, clients: list) -> None:
        key = (meta.master_address, meta.master_port, meta.group_name, meta.world_size, meta.backend)
        if self.pg is not None and self._group_key == key:
            return
        loop = asyncio.get_running_loop()
        make = loop.run_in_executor(None, self._make_group, meta)
        join = asyncio.ensure_future(call_all(clients, "init_weights_update_group", meta, timeout=meta.timeout_s))
        try:
            store, pg = await asyncio.wait_for(asyncio.shield(make), meta.timeout_s)
        except asyncio.TimeoutError as e:
            join.cancel()
            raise WeightSyncError(
                f"weight sync (distributed): server(s) {', '.join(peer_names(c) for c in clients)} did not join "
                f"group {meta.group_name!r} at {meta.master_address}:{meta.master_port} within "
                f"{meta.timeout_s:.1f}s") from e
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
        for t in tensors:
            self.pg.broadcast([t], opts).wait(timeout)

    async def _send_bucket(self, meta: WeightUpdateMeta, clients: list, names: list[str], tensors: list) -> None:
        specs = [ParamSpec(n, str(t.dtype).replace("torch.", ""), list(t.shape)) for n, t in zip(names, tensors)]
        http = asyncio.ensure_future(call_all(clients, "update_weights_from_distributed", meta, specs,
                                              timeout=meta.timeout_s))
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, self._broadcast, tensors, meta), meta.timeout_s + 5)
            t1 = time.perf_counter()
            self._phase["broadcast"] += t1 - t0
        except Exception as e:
            self.pg = None  # a failed collective leaves the group unusable; rebuild next time
            peers = ", ".join(peer_names(c) for c in clients)
            if http.done() and not http.cancelled() and http.exception() is not None:
                raise http.exception() from e  # the HTTP side knows which server failed
            http.cancel()
            raise WeightSyncError(f"weight sync (distributed): broadcast to server(s) {peers} failed or timed out "
                                  f"after {meta.timeout_s:.1f}s: {type(e).__name__}: {e}") from e
        await http
        self._phase["server_apply"] += time.perf_counter() - t1

    # -- main -----------------------------------------------------------------------------------
    def send(self, meta: WeightUpdateMeta, clients: list, named_tensors: NamedTensors, *,
             is_src: bool) -> WeightSyncError | None:
        import torch

        wire = getattr(torch, meta.dtype) if meta.dtype else None
        err: WeightSyncError | None = None
        t0 = time.perf_counter()
        if is_src:
            try:
                self.runner.run(call_all(clients, "pause_generation", timeout=meta.timeout_s))
                self.runner.run(self._ensure_group(meta, clients))
            except WeightSyncError as e:
                err = e
        t1 = time.perf_counter()
        names: list[str] = []
        bucket: list = []
        size = 0
        n_buckets = 0
        self._phase = {"broadcast": 0.0, "server_apply": 0.0}
        for name, t in named_tensors:
            if not is_src or err is not None:
                continue
            t = self._wire_tensor(name, t.detach(), wire)
            names.append(name)
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= meta.bucket_bytes:
                err = self._flush(meta, clients, names, bucket)
                n_buckets += 1
                names, bucket, size = [], [], 0
        if is_src and err is None and bucket:
            err = self._flush(meta, clients, names, bucket)
            n_buckets += 1
        if is_src:
            err = self._wait_pending() or err
            try:
                self.runner.run(call_all(clients, "continue_generation", timeout=meta.timeout_s))
            except WeightSyncError as e:
                err = err or e
            self.last_seconds = {"pause_init": t1 - t0, "transfer": time.perf_counter() - t1,
                                 "total": time.perf_counter() - t0, "buckets": float(n_buckets), **self._phase}
        return err

    def _wire_tensor(self, name: str, t, wire):
        """``t`` as sent: itself when dtype/device already match (zero-copy), else converted into a
        buffer kept across syncs (fresh allocations page-fault on every push)."""
        import torch

        dtype = wire if (wire is not None and t.is_floating_point()) else t.dtype
        if t.dtype == dtype and str(t.device) == str(torch.device(self.device)) and t.is_contiguous():
            return t
        buf = self._buffers.get(name)
        same_place = buf is not None and str(buf.device) == str(torch.device(self.device))
        if not same_place or buf.shape != t.shape or buf.dtype != dtype:
            buf = torch.empty(t.shape, dtype=dtype, device=self.device)
            self._buffers[name] = buf
        buf.copy_(t)
        return buf

    def _flush(self, meta, clients, names, bucket) -> WeightSyncError | None:
        """Start sending ``bucket`` once the previous one is done. Sending runs on the loop thread,
        so gathering/converting the next bucket overlaps with this one's broadcast and apply."""
        err = self._wait_pending()
        if err is not None:
            return err
        self._pending = asyncio.run_coroutine_threadsafe(
            self._send_bucket(meta, clients, list(names), list(bucket)), self.runner.loop)
        return None

    def _wait_pending(self) -> WeightSyncError | None:
        fut, self._pending = self._pending, None
        if fut is None:
            return None
        try:
            fut.result()
        except WeightSyncError as e:
            return e
        except Exception as e:  # anything unexpected still must not hang or go unnamed
            return WeightSyncError(f"weight sync (distributed): bucket send failed: {type(e).__name__}: {e}")
        return None

    def close(self) -> None:
        self.pg = None
        self.store = None
        self._buffers.clear()
