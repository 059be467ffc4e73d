"""The package's only door to torch.distributed collectives: each one is right on every backend.

A process group serves only the device types its backend registered: a plain ``"nccl"`` group has
no CPU backend ("No backend type associated with device type cpu"), and gloo is slow or incomplete
on CUDA tensors. Call sites hand both kinds (statistics and pipeline-stage handoffs live on the
host, activations on the GPU), so every tensor helper here moves its tensors to a device the
group serves and puts the result back on the caller's device; when the device already fits (the
CPU+gloo path, and ``cpu:gloo,cuda:nccl`` for either device) the call goes straight through, with
no copy. The device decision is the pure :func:`comm_device_type`, testable without CUDA.

The object collectives pass through unchanged (torch already picks their device from the group):
they live here so that one lint test (tests/unit/test_collectives_lint.py) can forbid direct
``torch.distributed`` collectives everywhere else. Arguments and semantics are torch's (``src``
and ``dst`` are global ranks). torch is imported at module level: nothing on the CLI's import path
imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# The device types torch registers for a single-backend string (a "device:backend,..." string names its own).
# gloo is registered for cuda too, but only some of its collectives take CUDA tensors: it counts as CPU here.
_SERVES = {"gloo": ("cpu",), "nccl": ("cuda",), "xccl": ("xpu",), "hccl": ("npu",)}


# ------------------------------------------------------------------ the device decision (pure)
def backend_devices(backend: str) -> tuple[str, ...]:
    """The device types a backend string serves: ``gloo`` -> ``("cpu",)``, ``nccl`` -> ``("cuda",)``,
    ``cpu:gloo,cuda:nccl`` -> ``("cpu", "cuda")``; ``()`` for a backend this module does not know."""
    name = str(backend).strip().lower()
    if ":" in name:
        return tuple(part.split(":", 1)[0].strip() for part in name.split(",") if part.strip())
    return _SERVES.get(name, ())


def comm_device_type(backend: str, tensor_device_type: str) -> str:
    """The device type a tensor on ``tensor_device_type`` must be on to go through ``backend``: its own
    when the backend serves it (or the backend is unknown: let torch decide), else the first one served."""
    served = backend_devices(backend)
    if not served or tensor_device_type in served:
        return tensor_device_type
    return served[0]


def group_backend(group: Any = None) -> str:
    """The backend string of ``group`` (the default group for None), e.g. ``cpu:gloo,cuda:nccl``."""
    return str(dist.get_backend(group))


def comm_device(backend_or_group: Any, device: torch.device | str) -> torch.device:
    """The device a tensor on ``device`` goes through ``backend_or_group`` from (a backend string, a
    process group, or None for the default group): ``device`` itself when it fits."""
    device = torch.device(device)
    backend = backend_or_group if isinstance(backend_or_group, str) else group_backend(backend_or_group)
    kind = comm_device_type(backend, device.type)
    if kind == device.type:
        return device
    if kind == "cuda":  # init_distributed set this rank's device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


# ------------------------------------------------------------------ staging
def _stage(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return t if t.device == dev else t.to(dev)


def _unstage(staged: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if staged is not t:
        t.copy_(staged)
    return t


# ------------------------------------------------------------------ tensor collectives
def all_reduce(t: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> torch.Tensor:
    """Reduce ``t`` in place over ``group``; returns ``t``."""
    c = _stage(t, comm_device(group, t.device))
    dist.all_reduce(c, op=op, group=group)
    return _unstage(c, t)


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """``src``'s ``t`` into ``t`` on every rank of ``group``; returns ``t``."""
    c = _stage(t, comm_device(group, t.device))
    dist.broadcast(c, src=src, group=group)
    return _unstage(c, t)


def all_gather(outs: Sequence[torch.Tensor], t: torch.Tensor, group: Any = None) -> Sequence[torch.Tensor]:
    """Every rank's ``t`` into ``outs`` (one tensor per rank of ``group``); returns ``outs``."""
    dev = comm_device(group, t.device)
    staged = [_stage(o, dev) for o in outs]
    dist.all_gather(staged, _stage(t, dev), group=group)
    for s, o in zip(staged, outs):
        _unstage(s, o)
    return outs


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 into ``out``; returns ``out``."""
    dev = comm_device(group, t.device)
    c = _stage(out, dev)
    dist.all_gather_into_tensor(c, _stage(t, dev), group=group)
    return _unstage(c, out)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None) -> torch.Tensor:
    """This rank's dim-0 slice of ``t`` reduced over ``group``, into ``out``; returns ``out``."""
    dev = comm_device(group, t.device)
    c = _stage(out, dev)
    dist.reduce_scatter_tensor(c, _stage(t, dev), op=op, group=group)
    return _unstage(c, out)


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None = None,
                      in_splits: list[int] | None = None, group: Any = None) -> torch.Tensor:
    """``t``'s dim-0 pieces (``in_splits``) to each rank of ``group``, theirs into ``out`` (``out_splits``);
    returns ``out``. Safe inside autograd functions: it only fills ``out``."""
    dev = comm_device(group, t.device)
    c = _stage(out, dev)
    dist.all_to_all_single(c, _stage(t, dev), out_splits, in_splits, group=group)
    return _unstage(c, out)


def send(t: torch.Tensor, dst: int, group: Any = None) -> None:
    dist.send(_stage(t, comm_device(group, t.device)), dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """``src``'s tensor into ``t``; returns ``t``."""
    c = _stage(t, comm_device(group, t.device))
    dist.recv(c, src=src, group=group)
    return _unstage(c, t)


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


# ------------------------------------------------------------------ object collectives
def broadcast_object_list(objs: list, src: int, group: Any = None) -> list:
    dist.broadcast_object_list(objs, src=src, group=group)
    return objs


def all_gather_object(out: list, obj: Any, group: Any = None) -> list:
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, out: list | None, dst: int, group: Any = None) -> list | None:
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def scatter_object_list(out: list, objs: list | None, src: int, group: Any = None) -> list:
    dist.scatter_object_list(out, objs, src=src, group=group)
    return out


def send_object_list(objs: list, dst: int, group: Any = None) -> None:
    dist.send_object_list(objs, dst=dst, group=group)


def recv_object_list(objs: list, src: int, group: Any = None) -> list:
    dist.recv_object_list(objs, src=src, group=group)
    return objs
