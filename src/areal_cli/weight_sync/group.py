"""The weight-update process group, built the way SGLang's receiver builds it.

SGLang's servers join with ``sglang.srt.utils.init_custom_process_group(backend, init_method=
"tcp://ADDR:PORT", world_size, rank=rank_offset + tp_rank, group_name)``: torch's ``tcp://``
rendezvous (a ``TCPStore`` hosted by rank 0), a ``PrefixStore(group_name, store)``, then torch's own
group creation, which adds its own key prefixes. The trainer (rank 0) and the built-in ``hf`` server must take exactly the same
steps, or their store keys never meet (both sides then wait until the timeout). This is an
independent implementation of those steps on torch's API; the contract test runs it against
SGLang's helper itself (tests/integration/inference/test_sglang_contract.py).

No default process group is needed: the group is registered with torch under ``group_name`` only.
"""

from __future__ import annotations

import datetime
import os
from typing import Any


def _drop_named(group_name: str) -> None:
    """torch refuses a second group under a name still registered in this process (a group left
    behind by a failed push); destroy that one first."""
    from torch.distributed.distributed_c10d import _world

    for pg, name in list(_world.pg_names.items()):
        if name == group_name:
            destroy_group(pg)


def make_group(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
               timeout_s: float) -> Any:
    """Join (rank 0: create and host the store of) the weight-update group; blocks until all
    ``world_size`` ranks have joined or ``timeout_s`` passes. Returns the process group."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world_size = int(rank), int(world_size)
    _drop_named(group_name)
    # What torch's tcp:// rendezvous builds in a process outside torchrun (SGLang's servers): rank 0
    # hosts a multi-tenant store, the others connect. Built here directly because under torchrun
    # (the trainer) that rendezvous would make rank 0 a client of torchrun's agent store instead
    # (TORCHELASTIC_USE_AGENT_STORE), and nobody would host the group's store.
    store = TCPStore(host_name=address.strip("[]"), port=int(port), world_size=world_size, is_master=rank == 0,
                     timeout=timeout, multi_tenant=True, use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    """Unregister and shut down a weight-update group; never raises (the group may be broken)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:  # a half-failed group: nothing more to release
        pass


def trainer_address(server_addresses: list[str]) -> str:
    """The address the servers dial to reach the trainer's group store: loopback when every server
    runs on this host, else this node's outward-facing IP (servers on other nodes cannot reach
    127.0.0.1)."""
    from areal_cli.utils.network import local_ip

    def host(addr: str) -> str:
        a = addr.split("://", 1)[-1]
        return a.rsplit(":", 1)[0].strip("[]") if ":" in a else a

    loopback = ("127.", "localhost", "::1")
    if server_addresses and all(host(a).startswith(loopback) for a in server_addresses):
        return "127.0.0.1"
    return local_ip()
