"""The trainer's side of weight delivery: which push, with which metadata, to which servers.

:class:`WeightPublisher` owns the protocol around the engine's senders: the push mode (``disk`` or
``distributed``, chosen once per run by ``inference.push_mode.resolved_weight_update``), the
``WeightUpdateMeta`` of each push, the first push of a run (through disk, at an exact version), the
adapter pushes under LoRA, and what happens when a server dies: once the launcher has restarted it
(:class:`~areal_cli.weight_sync.fleet.ServerFleet`), the restarted server is brought to the current
version through disk and the broadcast group is renamed, so the next distributed push builds a new
group that every server joins. The engine only streams its tensors into the senders.

Every method is collective over the trainer ranks; only rank 0 talks to servers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from areal_cli.errors import WeightSyncError
from areal_cli.utils.dist import barrier, broadcast_obj
from areal_cli.weight_sync.disk_layout import disk_update_meta, load_meta, prune_pushed
from areal_cli.weight_sync.fleet import ServerFleet


@dataclasses.dataclass
class PushTarget:
    """What a distributed push's group needs to know about the trainer and the servers."""

    world_size: int  # the trainer plus every TP rank of every server
    dtype: str | None  # wire dtype (None: the trainer's own)
    backend: str  # "nccl" or "gloo"


class WeightPublisher:
    """Pushes one trainer engine's weights to the servers of ``fleet`` in ``mode``."""

    def __init__(self, fleet: ServerFleet, mode: str, *, rank: int, target: PushTarget, lora: bool,
                 model_path: str):
        self.fleet, self.mode, self.rank = fleet, mode, rank
        self.target, self.lora = target, lora
        self.model_path = model_path  # the servers' base weights (and the tokenizer of a pushed dir)
        self.policy_path = model_path  # the RL phase's starting weights (an SFT warm start's export)
        self.last_push_disk = False
        self.before_push: Callable[[], None] | None = None  # e.g. pause the rollout executor

    @property
    def run_dir(self) -> str:
        return self.fleet.run_dir

    def _rank0_clients(self) -> list:
        return [self.fleet.client] if self.rank == 0 and self.fleet.client is not None else []

    # ------------------------------------------------------------------ metadata
    def meta(self, version: int, mode: str) -> Any:
        """The ``WeightUpdateMeta`` of a push of ``version`` (rank 0's; broadcast by :meth:`push`)."""
        from areal_cli.api.io_struct import WeightUpdateMeta

        if mode == "disk":
            return disk_update_meta(self.run_dir, version)
        from areal_cli.utils.network import find_free_port
        from areal_cli.weight_sync.group import trainer_address

        client = self.fleet.client
        # Every TP rank of every server joins the group (SGLang places them at rank_offset + tp_rank).
        meta = WeightUpdateMeta(type="distributed", version=version,
                                master_address=trainer_address(client.addresses if client else []),
                                master_port=find_free_port() if self.rank == 0 else 0,
                                world_size=self.target.world_size, dtype=self.target.dtype,
                                backend=self.target.backend)
        if self.fleet.group_epoch:
            # After a restart: a new name makes the sender build a new group, and the servers that kept
            # the old one (SGLang keeps groups by name) join it without clashing with the old name.
            meta = dataclasses.replace(meta, group_name=f"{meta.group_name}_r{self.fleet.group_epoch}")
        return meta

    # ------------------------------------------------------------------ pushes
    def push(self, engine: Any, version: int, *, force_disk: bool = False) -> float:
        """Push the current weights to every server at ``version``. Returns seconds spent."""
        t0 = time.perf_counter()
        mode = "disk" if force_disk else broadcast_obj(self.mode)
        meta = broadcast_obj(self.meta(version, mode) if self.rank == 0 else None)
        if self.before_push is not None:
            self.before_push()
        try:
            engine.update_weights(meta, self._rank0_clients(), loop=self.fleet.loop)
        except WeightSyncError:
            # A server that died just before or during the push: once the launcher has restarted it,
            # bring every server to `version` through disk (the broadcast group lost a member).
            if force_disk or not broadcast_obj(self.fleet.await_restart() is not None if self.rank == 0
                                               else None):
                raise
            self.sync_restarted(engine, version)
            return time.perf_counter() - t0 + self.push(engine, version, force_disk=True)
        engine.set_version(version)
        self.last_push_disk = mode == "disk"
        if mode == "disk" and self.rank == 0:
            prune_pushed(meta.path, keep=1)
        return time.perf_counter() - t0

    def push_initial(self, engine: Any, version: int) -> None:
        """Load the trainer's current weights into every server at ``version`` (through disk).

        Used at start-up (after an SFT warm start, or on resume), before any rollout runs.
        ``engine.update_weights`` always advances the version, so the version-0 case goes through
        the client's ``update_weights_from_disk`` directly.
        """
        if self.lora:
            self._push_adapter(engine, version, self._rank0_clients())
            return
        self._push_saved(engine, version, self._rank0_clients())
        if self.rank == 0:
            self.fleet.client.set_version(version)
        engine.set_version(version)

    def _push_saved(self, engine: Any, version: int, clients: list) -> None:
        """Collective: write the trainer's weights into the push dir of ``version`` with ``engine.save``;
        rank 0 then has ``clients`` load it. For pushes outside a sender: at start-up and to a restarted
        server, which must not join (or wait for) the other servers' weight-update group."""
        from areal_cli.api.io_struct import SaveLoadMeta

        meta = load_meta(disk_update_meta(self.run_dir, version))
        engine.save(SaveLoadMeta(path=meta.path, weight_format="hf", tokenizer_path=self.model_path))
        if self.rank == 0:
            for client in clients:
                self.fleet.run(client.update_weights_from_disk(meta))
        barrier()

    def _push_adapter(self, engine: Any, version: int, clients: list) -> None:
        """Collective, under LoRA: the adapter to ``clients`` (rank 0's) at ``version``, preceded by the
        SFT warm start's full weights (the adapter's base) when there was one."""
        meta = disk_update_meta(self.run_dir, version)
        if self.rank == 0 and self.policy_path != self.model_path:
            for client in clients:
                base = dataclasses.replace(meta, path=self.policy_path)
                self.fleet.run(client.update_weights_from_disk(base))
        engine.push_adapter(meta, clients if self.rank == 0 else [], loop=self.fleet.loop)

    # ------------------------------------------------------------------ restarts
    def sync_restarted(self, engine: Any, version: int) -> None:
        """Collective: bring restarted servers to ``version`` from disk, then route to them again.

        The broadcast group of distributed updates lost a member; the next distributed push makes a
        new group (``fleet.group_epoch``) that the restarted server joins like the others.
        """
        self.fleet.group_epoch += 1
        if self.lora:
            # Under LoRA a restarted server holds the base weights already: it only needs the adapter.
            pending = broadcast_obj(self.fleet.pending() if self.rank == 0 else None)
            self._push_adapter(engine, version, [self.fleet.client_for([r]) for r in pending])
            what = "adapter version "
        else:
            pending = self.fleet.pending() if self.rank == 0 else []
            self._push_saved(engine, version, [self.fleet.client_for([r]) for r in pending])
            what = "version "
        if self.rank == 0:
            self.fleet.rejoin(pending, what, version)

    def reload_from_disk(self, pushed: Any, recs: list[dict]) -> None:
        """Rank 0, without a control loop (``algo=sft``): every server of ``recs`` loads the dir a disk
        push wrote (``pushed``: its load meta), e.g. after the launcher restarted one of them."""
        import asyncio

        asyncio.run(self.fleet.client_for(recs).update_weights_from_disk(pushed))
