"""Running async code and torch ops from the trainer's synchronous threads.

Used by the trainer (its control loop, the SFT warm start's thread count), the engines (LoRA pushes)
and the weight-sync senders; it sits in ``utils`` because none of them owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
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
    (``max_head_offpolicyness=0``) trains while the servers idle, so it takes all of them; so does every
    step with ``shared=False`` (no server on this node).

    An async step stays on one thread after a step that waited for its batch: generation is then the
    bottleneck, and a second trainer thread would take the server's core. After a step whose batch was
    waiting, the servers still generate the next batch during part of the step, so whether a second
    thread pays depends on the model: on the 11.9M-parameter benchmark model two threads make the step
    1.2x faster, on the embedded default's 0.5M-parameter model they make it 1.1x slower (its ops are too
    small to gain from a thread that shares a core with the server). So the step times decide: the first
    ``PROBES`` ready-batch steps on each count, then the count whose recent steps were faster (median),
    with one step on the other count every ``REPROBE_EVERY`` steps in case the balance moved. Measured in
    benchmarks/results/train_threads.md."""

    WAIT_FRACTION = 0.1
    PROBES = 2
    REPROBE_EVERY = 20

    def __init__(self, most: int, sync: bool, shared: bool = True):
        self.most = max(1, int(most))
        self.always = bool(sync) or not shared  # every step takes ``most``: nothing competes for the cores
        self.n = self.most if self.always else 1
        self._times: dict[int, list[float]] = {self.most: [], 1: []}
        self._chosen = 0  # ready-batch steps since the last probe of the count not chosen

    def observe(self, wait_s: float, step_s: float) -> None:
        """After a step run on ``self.n`` threads: ``wait_s`` of its ``step_s`` seconds went to waiting for
        the batch. Sets ``self.n`` for the next step."""
        if self.always or self.most == 1:
            return
        if wait_s >= self.WAIT_FRACTION * step_s:
            self.n = 1
            return
        times = self._times[self.n]
        times.append(step_s)
        del times[:-2 * self.PROBES - 1]  # recent steps only: the balance moves with batch and length
        short = [c for c in (self.most, 1) if len(self._times[c]) < self.PROBES]
        if short:
            self.n = short[0]
            return
        best = min((self.most, 1), key=lambda c: statistics.median(self._times[c]))
        self._chosen += 1
        if self._chosen >= self.REPROBE_EVERY:
            self._chosen = 0
            best = 1 if best == self.most else self.most
        self.n = best
