"""Helpers shared by the disk and distributed weight-sync senders."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from areal_cli.errors import WeightSyncError


def peer_names(client: Any) -> str:
    """``host:port`` list of the servers behind one inference client, for error messages."""
    try:
        addrs = list(client.addresses)
    except Exception:  # a client without addresses still gets a readable name
        addrs = []
    return ",".join(addrs) if addrs else type(client).__name__


async def call_all(clients: Iterable[Any], method: str, *args: Any, timeout: float,
                   what: str | None = None, **kwargs: Any) -> None:
    """Await ``client.<method>(*args, **kwargs)`` on every client concurrently; the first failure or
    a timeout raises :class:`WeightSyncError` naming the peer(s)."""
    clients = list(clients)

    async def one(c):
        try:
            await asyncio.wait_for(getattr(c, method)(*args, **kwargs), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncError(f"weight sync: {what or method} to {peer_names(c)} timed out after "
                                  f"{timeout:.1f}s") from e
        except WeightSyncError:
            raise
        except Exception as e:  # transport errors from any client implementation
            raise WeightSyncError(f"weight sync: {what or method} to {peer_names(c)} failed: "
                                  f"{type(e).__name__}: {e}") from e

    results = await asyncio.gather(*(one(c) for c in clients), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
