"""Receiving new weights: from a safetensors dir on disk, or by broadcast from trainer rank 0.

Both paths first build a complete ``{name: tensor}`` dict and validate every name and shape
against the live model; only then the engine thread copies it in between two decode steps. A bad
update is rejected whole and never half-applied.

Broadcasts land in flat staging buffers kept across updates (one per dtype, grown on demand):
fresh allocations would page-fault on every push, and the apply step is then one tight
``param.copy_(staged)`` loop (``copy_`` converts dtype without a temporary).
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_cli.weight_sync.wire import WeightUpdateRejected, flat_layout, parse_dtype


class ReceiveFailed(RuntimeError):
    """The broadcast of a weight bucket failed; the model is untouched."""


_PARAMS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


def model_params(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by HF checkpoint name (tied weights appear once per name).

    Cached per model: updates copy into the same tensors, so the mapping never changes, and
    ``state_dict()`` walks every module (measurable on each bucket of a push)."""
    live = _PARAMS.get(model)
    if live is None:
        live = dict(model.state_dict(keep_vars=True))
        live.update(_per_expert_views(live))
        live.update(_hub_names(live))
        _PARAMS[model] = live
    return live


def _hub_names(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 nests a Qwen2-VL-family model's parts (``model.visual.*``, ``model.language_model.*``);
    the hub checkpoints, and the trainer's weight updates (engines/vision.py ``hub_name``), name them
    ``visual.*`` and ``model.*``. Both names are accepted: the same tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in live.items():
        if name.startswith("model.visual."):
            out[name[len("model."):]] = t
        elif name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = t
    return {k: v for k, v in out.items() if k not in live}


def _per_expert_views(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers keeps an MoE layer's experts fused (``experts.gate_up_proj [E, 2I, H]`` = [gate; up] per
    expert, ``experts.down_proj [E, H, I]``); checkpoints, vLLM and SGLang name them per expert
    (``experts.{e}.gate_proj.weight`` …). Both names are accepted: the per-expert ones are views into the fused
    tensors, so an update copies straight into them."""
    views: dict[str, torch.Tensor] = {}
    for name, t in live.items():
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                views[f"{base}{e}.gate_proj.weight"] = t.detach()[e, :inter]
                views[f"{base}{e}.up_proj.weight"] = t.detach()[e, inter:]
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                views[f"{base}{e}.down_proj.weight"] = t.detach()[e]
    return views


def validate(model, tensors: dict[str, torch.Tensor]) -> None:
    live = model_params(model)
    unknown = [n for n in tensors if n not in live]
    if unknown:
        raise WeightUpdateRejected(f"unknown parameter names (first 5): {unknown[:5]}")
    bad = [(n, list(t.shape), list(live[n].shape)) for n, t in tensors.items() if t.shape != live[n].shape]
    if bad:
        n, got, want = bad[0]
        raise WeightUpdateRejected(f"shape mismatch for {n}: got {got}, model has {want} "
                                   f"({len(bad)} tensor(s) mismatched); nothing was applied")


def apply(model, tensors: dict[str, torch.Tensor], threads: int | None = None) -> int:
    """Copy validated tensors into the model (call from the engine thread only).

    ``threads``: torch intra-op threads for the copy (1 while a broadcast is being received
    concurrently: spinning OpenMP workers would starve the receiving thread)."""
    live = model_params(model)
    prev = torch.get_num_threads()
    if threads and threads != prev:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            for n, t in tensors.items():
                live[n].copy_(t)  # converts dtype/device in place, no temporary
    finally:
        if threads and threads != prev:
            torch.set_num_threads(prev)
    return len(tensors)


def queue_apply(engine, tensors: dict[str, torch.Tensor], version: int | None, *, pause: bool = False,
                resume: bool = False, threads: int | None = 1) -> concurrent.futures.Future:
    """Queue the copy of a validated bucket (and the version bump) on the engine thread; returns the
    future of the number of tensors copied (a failed copy is its exception).

    ``pause`` / ``resume``: at the same token boundary, right after the copy, abort the running
    requests and hold new ones (what ``/pause_generation`` does) / let generation go on (what
    ``/continue_generation`` does). No decode step falls between the copy and the abort, so the
    aborted requests hold only tokens of the old weights (their resubmissions are prefilled with
    the new ones) and every token sampled afterwards carries the new version — the same outcome as
    pause → update → continue, without the two extra round trips. The copy is queued first so the
    update's reply is not queued behind the aborted requests' replies in the server's event loop."""

    def copy_in() -> int:
        n = apply(engine.model, tensors, threads=threads)
        if version is not None:
            engine.version = version
        return n

    with engine.same_boundary():
        copied = engine.call(copy_in)
        if pause:
            engine.pause()
        if resume:
            engine.resume()
    return copied


def default_allowed_roots(model_path: str) -> list[str]:
    return [str(Path(model_path).resolve().parent), str(Path(tempfile.gettempdir()).resolve())]


def check_allowed(path: str, roots: list[str]) -> Path:
    p = Path(path).resolve()
    for r in roots:
        rp = Path(r).resolve()
        if p == rp or rp in p.parents:
            return p
    raise PermissionError(f"{path} is outside the allowed weight roots {roots}; "
                          "start the server with --allowed-weight-roots to widen them")


def load_from_disk(model, path: str, roots: list[str]) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` file of an HF-layout dir (or one file) and validate it."""
    from safetensors.torch import load_file

    p = check_allowed(path, roots)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    elif p.suffix == ".safetensors":
        files = [p]
    else:
        files = []
    if not p.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not files:
        raise WeightUpdateRejected(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    validate(model, tensors)
    return tensors


def bucket_layout(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[tuple[torch.dtype, int, int]],
                                                                       dict[torch.dtype, int]]:
    """Where each tensor of a bucket sits in the per-dtype staging buffers: ``[(dtype, offset, numel)]``
    in request order, and the total element count per dtype (in order of first appearance)."""
    slots: list[tuple[torch.dtype, int, int]] = []
    totals: dict[torch.dtype, int] = {}
    for dt, shp in zip(dtypes, shapes):
        d = parse_dtype(dt)
        n = 1
        for x in shp:
            n *= int(x)
        off = totals.get(d, 0)
        slots.append((d, off, n))
        totals[d] = off + n
    return slots, totals


@dataclass
class DistributedReceiver:
    """Membership in the trainer's weight-update group (built without the default group)."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    pg: object
    store: object
    # Two staging slots: bucket k+1 is received while bucket k is still being copied into the model.
    # A slot's lock is held from its receive until its apply finished; ``_recv_lock`` serialises use
    # of the process group (and the order in which applies are queued).
    _staging: list[dict[torch.dtype, torch.Tensor]] = field(default_factory=lambda: [{}, {}], repr=False)
    _slot_locks: list[threading.Lock] = field(default_factory=lambda: [threading.Lock(), threading.Lock()],
                                              repr=False)
    _recv_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next_slot: int = 0

    @classmethod
    def join(cls, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str = "gloo", timeout_s: float = 120.0) -> "DistributedReceiver":
        """Join as rank ``rank_offset`` (one process, so TP rank 0), exactly as SGLang's servers join."""
        from areal_cli.weight_sync.group import make_group

        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightUpdateRejected("backend 'nccl' needs CUDA; this server runs on CPU — use 'gloo'")
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateRejected(f"unknown backend {backend!r}; expected gloo or nccl")
        pg = make_group(backend, master_address, int(master_port), int(world_size), int(rank_offset), group_name,
                        timeout_s)
        return cls(group_name, int(rank_offset), int(world_size), backend, pg, None)

    def _flat(self, slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        device = "cuda" if self.backend == "nccl" else "cpu"
        bufs = self._staging[slot]
        buf = bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            bufs.pop(dtype, None)  # free the old one before allocating the bigger one
            buf = torch.empty(numel, dtype=dtype, device=device)
            bufs[dtype] = buf
        return buf

    def _receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], flattened: bool,
                 flat_buffer: Callable[[torch.dtype, int], torch.Tensor]) -> dict[str, torch.Tensor]:
        """One ``broadcast(root=0)`` per tensor, in order, or with ``flattened`` one of the whole
        bucket as bytes (see :func:`flat_layout`)."""
        if flattened:
            fslots, nbytes = flat_layout(dtypes, shapes)
            buf = flat_buffer(torch.uint8, nbytes)[:nbytes]
            self.pg.broadcast(buf, 0).wait()
            return {n: buf[off:off + k * d.itemsize].view(d).view([int(x) for x in shp])
                    for n, (d, off, k), shp in zip(names, fslots, shapes)}
        slots, totals = bucket_layout(dtypes, shapes)
        flats = {d: flat_buffer(d, n) for d, n in totals.items()}
        views = [flats[d][off:off + k].view([int(x) for x in shp]) for (d, off, k), shp in zip(slots, shapes)]
        # (tensor, root) overload; a list would need BroadcastOptions
        for t in views:
            self.pg.broadcast(t, 0).wait()
        return dict(zip(names, views))

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                flattened: bool = False) -> dict[str, torch.Tensor]:
        """Receive one bucket into fresh tensors (for callers that keep them)."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        with self._recv_lock:
            return self._receive(names, dtypes, shapes, flattened,
                                 lambda d, n: torch.empty(n, dtype=d, device=device))

    def receive_and_apply(self, names: list[str], dtypes: list[str], shapes: list[list[int]], flattened: bool,
                          apply: Callable[[dict[str, torch.Tensor]], concurrent.futures.Future]
                          ) -> concurrent.futures.Future:
        """Receive a bucket into a staging slot and hand the views to ``apply`` (which queues the copy
        on the engine thread and returns its future). Returns that future; the slot stays locked
        until it is done, so a later bucket never overwrites data not yet copied in. Raises
        :class:`ReceiveFailed` if the broadcast fails (nothing queued)."""
        with self._recv_lock:
            slot = self._next_slot
            self._next_slot = 1 - slot
            lock = self._slot_locks[slot]
            lock.acquire()
            try:
                tensors = self._receive(names, dtypes, shapes, flattened,
                                        lambda d, n: self._flat(slot, d, n))
                fut = apply(tensors)  # queued under _recv_lock: applies run in bucket order
            except BaseException as e:
                lock.release()
                if isinstance(e, Exception):
                    raise ReceiveFailed(str(e)) from e
                raise
        fut.add_done_callback(lambda _f: lock.release())
        return fut

    def drain(self, names: list[str], dtypes: list[str], shapes: list[list[int]], flattened: bool) -> None:
        """Receive and discard a rejected bucket so the collective stays in step with the trainer."""
        self.receive(names, dtypes, shapes, flattened)

    def close(self) -> None:
        from areal_cli.weight_sync.group import destroy_group

        self._staging = [{}, {}]
        destroy_group(self.pg)


def broadcast_from_root(pg, tensor: torch.Tensor) -> None:
    """``broadcast([tensor], root=0)`` on a bare c10d process group (no default group needed)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


def check_update_request(model, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> str | None:
    """Why this distributed update would be rejected, or None. Checked before receiving."""
    if not (len(names) == len(dtypes) == len(shapes)):
        return f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}"
    live = model_params(model)
    for n, dt, shp in zip(names, dtypes, shapes):
        try:
            parse_dtype(dt)
        except WeightUpdateRejected as e:
            return str(e)
        if n not in live:
            return f"unknown parameter name {n!r}"
        if list(live[n].shape) != [int(x) for x in shp]:
            return f"shape mismatch for {n}: got {list(shp)}, model has {list(live[n].shape)}"
    return None

