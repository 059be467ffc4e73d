"""Running async code and torch ops from the trainer's synchronous threads.

Used by the trainer (its control loop, the SFT warm start's thread count), the engines (LoRA pushes)
and the weight-sync senders; it sits in ``utils`` because none of them owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


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
            self._thread = threading.Thread(target=loop.run_forever, name="areal-loop-runner", daemon=True)
            self._thread.start()
        self.loop = loop

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def close(self) -> None:
        if self._own and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


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


def cores_per_rank(local_world: int) -> int:
    """This process's usable cores (its affinity mask), split among the node's ``local_world`` ranks."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world))


class StepThreads:
    """Intra-op threads of a CPU trainer's RL step, on cores it shares with the inference servers.

    ``most`` is the rank's share of the node's cores (trainer/rl.py:step_threads derives it from the
    layout; without one the trainer keeps the process's thread count). A sync step
    (``max_head_offpolicyness=0``) trains while the servers idle, so it takes all of them. An async step
    does too when its batch was already waiting (the servers are ahead and idle for the rest of the
    step), and stays on one thread after a step that waited for its batch: generation is then the
    bottleneck, and a second trainer thread would take the server's core. With ``shared=False`` (no
    server on this node) every step takes them. Measured in benchmarks/results/train_threads.md."""

    WAIT_FRACTION = 0.1

    def __init__(self, most: int, sync: bool, shared: bool = True):
        self.most = max(1, int(most))
        self.always = bool(sync) or not shared  # every step takes ``most``: nothing competes for the cores
        self.n = self.most if self.always else 1

    def observe(self, wait_s: float, step_s: float) -> None:
        """After a step: ``wait_s`` of its ``step_s`` seconds went to waiting for the batch."""
        if not self.always and self.most > 1:
            self.n = self.most if wait_s < self.WAIT_FRACTION * step_s else 1
