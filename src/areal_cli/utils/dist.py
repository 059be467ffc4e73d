"""torch.distributed helpers of the trainer processes: the process-group bootstrap (torchrun env vars
or a single process) and the few collectives the trainer loops use between ranks.

One module for both the engines and the trainer loops (rl, sft, checkpoints), so neither reaches into the
other for them. Every function is a no-op (or the identity) without an initialised group, so the same
code runs as one plain process. torch is imported inside the functions: the CLI imports nothing here.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

_EXIT_HOOK = False


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device() -> "str":
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group and return ``(rank, world_size)``.

    Reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` as set by torchrun or srun. Without
    them it starts a one-process group on a free local port, so the same trainer code runs as a
    plain ``python`` process. Idempotent: an existing default group is reused.
    """
    import torch
    import torch.distributed as dist

    global _EXIT_HOOK
    if not _EXIT_HOOK:
        # A process that exits with the group alive can abort in interpreter teardown (gloo's worker
        # threads still hold work: "terminate called without an active exception", SIGABRT; seen with
        # DeepSpeed and with archon's all-to-all, pytorch#190489). The trainer destroys the group itself;
        # this covers every other caller, and a group someone else created. Idempotent, no collective.
        atexit.register(destroy_distributed)
        _EXIT_HOOK = True
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from areal_cli.utils import host_memory

    host_memory.configure()  # before the engine allocates the model's host tensors
    backend = backend or default_backend()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        from areal_cli.utils.network import find_free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ.setdefault("LOCAL_RANK", "0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def send_to_rank0(t: "torch.Tensor | None", owner: int) -> "torch.Tensor | None":
    """Move ``t`` from global rank ``owner`` to global rank 0, point to point (only those two call it;
    the shape and dtype travel first). Returns the tensor on rank 0, None on ``owner`` (unless it is 0)."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    if owner == 0:
        return t
    if me == owner:
        dist.send_object_list([tuple(t.shape), t.dtype], dst=0)
        dist.send(t.contiguous(), dst=0)
        return None
    if me == 0:
        meta: list = [None, None]
        dist.recv_object_list(meta, src=owner)
        out = torch.empty(meta[0], dtype=meta[1])
        dist.recv(out, src=owner)
        return out
    return None


def barrier() -> None:
    """All ranks meet here; nothing to wait for without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_obj(obj: Any, src: int = 0) -> Any:
    """``src``'s ``obj`` on every rank (pickled through ``broadcast_object_list``)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
