"""Adapter-only weight sync: under LoRA the servers keep the base weights and receive only the adapter.

The servers serve the adapter under one name (:data:`SERVED_NAME`); every generation request names it
(SGLang's ``lora_path``, vLLM's ``model``), so rollouts and evaluations run the current policy. A push
of version ``v``:

- disk: write ``<meta.path>/v<v>/`` in peft's layout (``adapter_config.json``,
  ``adapter_model.safetensors``), then each client's ``load_lora_adapter(name, dir, v)``: on the ``hf``
  server one ``/load_lora_adapter`` with ``replace`` and ``weight_version`` (swapped at one token boundary);
  on SGLang pause → ``/unload_lora_adapter`` → ``/load_lora_adapter`` → ``/update_weight_version`` →
  continue; on vLLM the same with ``/v1/unload_lora_adapter`` / ``/v1/load_lora_adapter``.
- distributed (``hf`` only): the full-weight path's group (joined once, reused; the same
  :class:`~areal_cli.weight_sync.senders.DistributedSender` owns it), then one
  ``/load_lora_adapter_from_distributed`` request per server while the adapter goes out as one
  flattened uint8 broadcast (the layout of :func:`areal_cli.weight_sync.wire.flat_layout`).

Versions advance exactly as with full weights (``/model_info``'s ``weight_version``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta
from areal_cli.api.weight_receiver import WeightReceiver
from areal_cli.errors import WeightSyncError
from areal_cli.utils.concurrency import LoopRunner
from areal_cli.weight_sync.common import call_all, peer_names
from areal_cli.weight_sync.disk_layout import versioned_dir
from areal_cli.weight_sync.senders import DistributedSender

SERVED_NAME = "areal-policy"


def flat_pack(tensors: dict[str, Any]) -> tuple[list[ParamSpec], Any]:
    """The tensors' bytes in one uint8 buffer, each at the receiver's offset for its dtype."""
    import torch

    from areal_cli.weight_sync.wire import flat_layout

    names = list(tensors)
    specs = [ParamSpec(n, str(tensors[n].dtype).replace("torch.", ""), list(tensors[n].shape)) for n in names]
    slots, nbytes = flat_layout([s.dtype for s in specs], [s.shape for s in specs])
    if len({t.dtype for t in tensors.values()}) == 1:  # one dtype: the slots are back to back, one cat
        return specs, torch.cat([tensors[n].detach().reshape(-1) for n in names]).view(torch.uint8)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    for n, (dtype, off, k) in zip(names, slots):
        buf[off:off + k * dtype.itemsize].view(dtype).copy_(tensors[n].detach().reshape(-1).to(dtype))
    return specs, buf


class AdapterSender:
    """Sends the adapter (a dict of full tensors on the source rank) to every client, disk or broadcast."""

    def __init__(self, runner: LoopRunner):
        self.runner = runner
        self.group = DistributedSender(runner)  # owns the weight-update group for distributed pushes
        self.last_seconds: dict[str, float] = {}

    def send(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], tensors: dict[str, Any],
             peft_config: Any, *, is_src: bool) -> WeightSyncError | None:
        if not is_src:
            return None
        t0 = time.perf_counter()
        try:
            if meta.type == "disk":
                self._disk(meta, clients, tensors, peft_config)
            elif meta.type == "distributed":
                self.runner.run(self._distributed(meta, clients, tensors, peft_config))
            else:
                return WeightSyncError(f"weight sync: unknown type {meta.type!r} (use disk or distributed)")
        except WeightSyncError as e:
            if meta.type == "distributed":
                self.group.pg = None  # a server may have left: rebuild the group next time
            return e
        self.last_seconds = {"total": time.perf_counter() - t0, "adapter_bytes":
                             float(sum(t.numel() * t.element_size() for t in tensors.values()))}
        return None

    def _disk(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], tensors: dict[str, Any],
              peft_config: Any) -> None:
        from areal_cli.weight_sync.adapter_files import write_adapter_dir

        if not meta.path:
            raise WeightSyncError("weight sync (disk): WeightUpdateMeta.path is empty — set the directory "
                                  "the servers can read")
        out = versioned_dir(meta.path, meta.version)
        try:
            write_adapter_dir(out, tensors, peft_config)
        except OSError as e:
            raise WeightSyncError(f"weight sync (disk): cannot write the adapter to {out}: {e}") from e
        self.runner.run(call_all(clients, lambda c: c.load_lora_adapter(SERVED_NAME, out, meta.version),
                                 timeout=meta.timeout_s, what="load_lora_adapter"))

    async def _distributed(self, meta: WeightUpdateMeta, clients: list[WeightReceiver], tensors: dict[str, Any],
                           peft_config: Any) -> None:
        bad = [peer_names(c) for c in clients if not c.supports_lora_broadcast]
        if bad:
            raise WeightSyncError(f"weight sync (distributed): server(s) {', '.join(bad)} load adapters "
                                  "from a directory only; use rollout.weight_update=disk with LoRA")
        await self.group._ensure_group(meta, clients)
        import torch

        from areal_cli.weight_sync.adapter_files import config_dict

        wire = getattr(torch, meta.dtype) if meta.dtype else None  # as full pushes: the wire dtype
        if wire is not None:
            tensors = {n: (t.to(wire) if t.is_floating_point() else t) for n, t in tensors.items()}
        specs, buf = flat_pack(tensors)
        config = config_dict(peft_config)
        request = asyncio.ensure_future(call_all(
            clients, lambda c: c.load_lora_adapter_from_distributed(meta, SERVED_NAME, config, specs),
            timeout=meta.timeout_s, what="load_lora_adapter_from_distributed"))
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.group._broadcast, [buf], meta)
        except Exception as e:
            request.cancel()
            raise WeightSyncError(f"weight sync (distributed): adapter broadcast in group "
                                  f"{meta.group_name!r} failed: {e}") from e
        await request

    def close(self) -> None:
        self.group.close()
