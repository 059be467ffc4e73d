"""Helpers shared by the disk and distributed weight-sync senders."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from areal_cli.api.weight_receiver import WeightReceiver
from areal_cli.errors import WeightSyncError


def peer_names(client: Any) -> str:
    """``host:port`` list of the servers behind one inference client, for error messages."""
    try:
        addrs = list(client.addresses)
    except Exception:  # a client without addresses still gets a readable name
        addrs = []
    return ",".join(addrs) if addrs else type(client).__name__


async def call_all(clients: Iterable[WeightReceiver], call: Callable[[WeightReceiver], Awaitable[Any]], *,
                   timeout: float, what: str) -> None:
    """Await ``call(client)`` (one :class:`~areal_cli.api.weight_receiver.WeightReceiver` method) on
    every client concurrently; the first failure or a timeout raises :class:`WeightSyncError` naming
    ``what`` and the peer(s)."""
    clients = list(clients)

    async def one(c: WeightReceiver) -> None:
        try:
            await asyncio.wait_for(call(c), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncError(f"weight sync: {what} to {peer_names(c)} timed out after "
                                  f"{timeout:.1f}s") from e
        except WeightSyncError:
            raise
        except Exception as e:  # transport errors from any client implementation
            raise WeightSyncError(f"weight sync: {what} to {peer_names(c)} failed: "
                                  f"{type(e).__name__}: {e}") from e

    results = await asyncio.gather(*(one(c) for c in clients), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
