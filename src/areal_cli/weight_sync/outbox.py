"""One trainer engine's senders: the push picks one, the engine only streams its tensors in.

The engine hands over what it has: ``full(to_cpu)``, the ``(name, tensor | None)`` stream of its full
weights (every rank drives it in lockstep); ``write_dir``, how it writes an HF dir from that stream;
and under LoRA ``adapter``, its adapter tensors and peft config. :class:`Outbox` picks the sender of
the push (the adapter's, disk, or broadcast), keeps it across pushes (a broadcast sender keeps its group
and staging buffers) and raises a failure on every rank. What to push and when is
:class:`~areal_cli.weight_sync.publisher.WeightPublisher`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_cli.api.io_struct import WeightUpdateMeta
from areal_cli.api.weight_receiver import WeightReceiver
from areal_cli.errors import ConfigError, WeightSyncError
from areal_cli.weight_sync.senders import NamedTensors


class Outbox:
    """The senders of one trainer engine, one per kind, created on first use."""

    def __init__(self) -> None:
        self.senders: dict[str, Any] = {}  # "disk" | "distributed" | "lora" -> sender
        self.runner: Any = None  # LoopRunner on rank 0: the event loop the clients' calls run on
        self.last: Any = None  # the sender of the last push (its phase timings)

    def send(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], *, loop: Any,
             full: Callable[[bool], NamedTensors], write_dir: Callable[[str, NamedTensors], None],
             adapter: tuple[Callable[[], dict[str, Any]], Any] | None, device: Any) -> None:
        """Collective: push ``meta.version`` to ``clients`` (rank 0's). Raises :class:`WeightSyncError`
        on every rank when the push failed on the source rank."""
        import torch.distributed as dist

        from areal_cli.utils import collectives, host_memory
        from areal_cli.utils.concurrency import LoopRunner
        from areal_cli.weight_sync.senders import DiskSender, DistributedSender

        is_src = dist.get_rank() == 0
        if is_src and self.runner is None:
            self.runner = LoopRunner(loop)
        err: WeightSyncError | None = None
        if adapter is not None:  # the servers keep the base: only the adapter moves
            from areal_cli.weight_sync.lora import AdapterSender

            tensors, peft_config = adapter
            sender = self.senders.setdefault("lora", AdapterSender(self.runner))
            err = sender.send(meta, clients, tensors(), peft_config, is_src=is_src)
        elif meta.type == "disk":
            sender = self.senders.setdefault("disk", DiskSender(self.runner))
            err = sender.send(meta, clients, full(True), is_src=is_src, write_dir=write_dir)
        elif meta.type == "distributed":
            # NCCL broadcasts from the GPU; gloo from host memory.
            on_gpu = meta.backend == "nccl" and device.type == "cuda"
            sender = self.senders.setdefault("distributed", DistributedSender(self.runner))
            sender.device = str(device) if on_gpu else "cpu"
            err = sender.send(meta, clients, full(not on_gpu), is_src=is_src)
        else:
            raise ConfigError("weight_sync.type", f"unknown type {meta.type!r}", "use disk or distributed")
        self.last = sender
        host_memory.release()
        msg = [str(err) if err is not None else None]
        if dist.get_world_size() > 1:
            collectives.broadcast_object_list(msg, src=0)
        if msg[0] is not None:
            raise err if err is not None else WeightSyncError(msg[0])

    @property
    def last_seconds(self) -> dict[str, float]:
        return dict(self.last.last_seconds) if self.last is not None else {}

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.senders.clear()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
