"""Helpers shared by the disk and distributed weight-sync senders."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from areal_cli.errors import WeightSyncError

T = TypeVar("T")


def peer_names(client: Any) -> str:
    """``host:port`` list of the servers behind one inference client, for error messages."""
    try:
        addrs = list(client.addresses)
    except Exception:  # a client without addresses still gets a readable name
        addrs = []
    return ",".join(addrs) if addrs else type(client).__name__


class LoopRunner:
    """Runs coroutines from synchronous trainer code.

    Uses ``loop`` when given (e.g. the rollout executor's loop that owns the clients' HTTP
    sessions), otherwise a private event loop on a daemon thread that lives as long as the sender,
    so clients that cache a session keep using the same loop across updates.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._own = loop is None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="areal-weight-sync", daemon=True)
            self._thread.start()
        self.loop = loop

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def close(self) -> None:
        if self._own and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


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


@contextlib.contextmanager
def torch_threads(n: int):
    """Run torch ops with ``n`` intra-op threads, then restore the previous count.

    Weight sync casts/copies tensors while another thread of the same process drives the broadcast
    socket; with more OpenMP workers than free cores the workers' spin-waits starve it (measured:
    ~3x slower pushes on a loaded 2-core host)."""
    import torch

    prev = torch.get_num_threads()
    if prev != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if prev != n:
            torch.set_num_threads(prev)
