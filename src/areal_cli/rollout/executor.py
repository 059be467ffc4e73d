"""The rollout executor: a background asyncio loop that keeps episodes running within the staleness bound.

The trainer (one per data-parallel head) talks to it from its own thread:

    ex = RolloutExecutor(engine, workflow, batch_size=B, max_concurrent=64, max_head_offpolicyness=k)
    batch = ex.prepare_batch(dataloader)     # keeps the pipeline full, returns B episodes
    ... train, version += 1 ...
    ex.pause()                               # stop admitting new episodes
    ex.run_coroutine(engine.pause_generation()); push weights; ex.run_coroutine(engine.continue_generation())
    ex.set_version(version)                  # only after every server holds the new weights
    ex.resume()

Release order. ``wait`` hands out finished episodes in order of the policy version at which they were
admitted (``submit_version``); episodes admitted at the same version are released in completion order.
A finished episode is held back while an episode admitted at an *older* version is still running.
Together with the capacity rule in :mod:`areal_cli.rollout.staleness` this makes the bound exact:
if the trainer consumes ``batch_size`` episodes per version, an episode admitted at version ``s`` is
consumed at version ``<= s + k``, and since every token of it is generated at a version ``>= s``, no
consumed token is more than ``k`` versions old. Completion-order release alone (AReaL-lite) lets a
long straggler drift arbitrarily far behind.

``pause()`` only stops admitting new episodes; it does not touch the servers. The trainer calls the
engine's ``pause_generation``/``continue_generation`` and weight-update methods itself (use
:meth:`RolloutExecutor.run_coroutine` so they run on the same event loop as the episodes).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.errors import ArealError, ConfigError, DataError
from areal_cli.rollout.staleness import StalenessManager, VersionCounter, VersionProvider

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.inference_api import InferenceEngine

logger = logging.getLogger(__name__)

ShouldAccept = Callable[[Trajectory], bool]


class RolloutError(RuntimeError):
    """An episode raised; re-raised in the trainer's thread by ``wait``/``prepare_batch``."""


class RolloutQueueFull(RuntimeError):
    """``submit(block=False)`` (or a timed-out blocking submit) found the input queue full."""


@dataclass
class _Done:
    seq: int
    submit_version: int
    traj: Trajectory
    finished: float


@dataclass
class _Totals:
    consumed: int = 0
    failed: int = 0
    batches: int = 0
    max_token_staleness: int = 0
    last_batch: dict[str, float] = field(default_factory=dict)


def staleness_stats(traj: Trajectory, version: int) -> dict[str, float]:
    """Token staleness (``version - token version``) over generated tokens of ``traj``."""
    import torch

    versions = traj.data["versions"]
    gen = versions >= 0
    if "loss_mask" in traj.data:
        gen = gen & traj.data["loss_mask"].bool()
    if not bool(gen.any()):
        return {"staleness/max": 0.0, "staleness/mean": 0.0, "staleness/min_version": float(version),
                "staleness/n_tokens": 0.0}
    lag = (version - versions[gen]).to(torch.float64)
    return {"staleness/max": float(lag.max()), "staleness/mean": float(lag.mean()),
            "staleness/min_version": float(versions[gen].min()), "staleness/n_tokens": float(gen.sum())}


class RolloutExecutor:
    """Runs ``workflow.arun_episode`` for submitted items on a background event loop.

    ``batch_size`` counts episodes (prompts / groups), the unit the staleness bound is expressed in.
    ``queue_size`` bounds the input queue (items submitted but not yet admitted); finished-but-unconsumed
    episodes are bounded by the staleness capacity itself (at most ``(k + 1) * batch_size`` per version).
    """

    def __init__(self, engine: "InferenceEngine", workflow: RolloutWorkflow, *, batch_size: int,
                 max_concurrent: int, max_head_offpolicyness: int, queue_size: int | None = None,
                 should_accept: ShouldAccept | None = None, version_provider: VersionProvider | None = None,
                 pad_token_id: int = 0, poll_interval_s: float = 0.05, reject_patience: int = 0):
        if not hasattr(workflow, "arun_episode"):
            raise ConfigError("workflow.name", f"{type(workflow).__name__} has no arun_episode(engine, data)",
                              "subclass areal_cli.api.workflow_api.RolloutWorkflow")
        queue_size = 4 * batch_size if queue_size is None else queue_size
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError("rollout.queue_size", f"must be a positive integer, got {queue_size!r}",
                              "set rollout.queue_size=null (4 x batch) or a positive integer")
        self.engine = engine
        self.workflow = workflow
        self.batch_size = int(batch_size)
        self.queue_size = int(queue_size)
        self.should_accept = should_accept
        # Episodes ``should_accept`` may turn down in a row before the run stops (0: never). Without it a
        # filter that rejects everything (DAPO's on data the model always or never solves) waits for ever.
        self.reject_patience = int(reject_patience)
        self._rejects_in_row = 0
        self.pad_token_id = int(pad_token_id)
        if version_provider is None:
            version_provider = VersionCounter(_initial_version(engine))
        self.version_provider = version_provider
        # Counting starts now: a new executor on servers already at version v0 owes nothing for v < v0.
        self.staleness = StalenessManager(max_concurrent, max_head_offpolicyness, batch_size,
                                          version_provider, start_version=version_provider.get_version())
        self._poll = float(poll_interval_s)

        self._input: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=self.queue_size)
        self._overflow: deque[dict[str, Any]] = deque()  # taken from a dataloader, not yet queued
        self._cond = threading.Condition()
        self._ready: list[_Done] = []
        self._running: dict[int, int] = {}  # seq -> submit_version
        self._error: BaseException | None = None
        self._totals = _Totals()
        self._seq = itertools.count()
        self._paused = threading.Event()
        self._exiting = threading.Event()
        self._data_iters: dict[int, tuple[Any, Iterator[Any]]] = {}

        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        started = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(started,), name="rollout-executor",
                                        daemon=True)
        self._thread.start()
        started.wait()

    # ------------------------------------------------------------------ background loop
    def _thread_main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        started.set()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _main(self) -> None:
        assert self._wake is not None
        while not self._exiting.is_set():
            self._wake.clear()
            self._admit()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._poll)
            except asyncio.TimeoutError:
                pass
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _admit(self) -> None:
        if self._paused.is_set() or self._error is not None:
            return
        version = self.version_provider.get_version()
        capacity = self.staleness.get_capacity(version)
        while capacity > 0:
            try:
                data = self._input.get_nowait()
            except queue.Empty:
                return
            seq = next(self._seq)
            self.staleness.on_submit()
            with self._cond:
                self._running[seq] = version
            task = self._loop.create_task(self._run_episode(seq, version, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            capacity -= 1

    async def _run_episode(self, seq: int, version: int, data: dict[str, Any]) -> None:
        start = time.monotonic()
        try:
            traj = await self.workflow.arun_episode(self.engine, data)
            accept = traj is not None and (self.should_accept is None or bool(self.should_accept(traj)))
        except asyncio.CancelledError:
            self.staleness.on_reject()
            with self._cond:
                self._running.pop(seq, None)
                self._cond.notify_all()
            raise
        except Exception as e:  # noqa: BLE001 - surfaced to the trainer by wait()
            logger.exception("rollout episode %d failed", seq)
            self.staleness.on_reject()
            with self._cond:
                self._running.pop(seq, None)
                self._totals.failed += 1
                if self._error is None:
                    self._error = e
                self._cond.notify_all()
            return
        if accept:
            assert traj is not None
            traj.meta.update({"episode_id": seq, "submit_version": version,
                              "rollout_latency_s": time.monotonic() - start})
            self.staleness.on_accept()
        else:
            self.staleness.on_reject()
        with self._cond:
            self._running.pop(seq, None)
            if accept:
                self._ready.append(_Done(seq, version, traj, time.monotonic()))
                self._rejects_in_row = 0
            elif traj is not None:
                self._rejects_in_row += 1
                if self.reject_patience and self._rejects_in_row >= self.reject_patience and self._error is None:
                    self._error = ConfigError(
                        "algo.dynamic_sampling", f"{self._rejects_in_row} groups in a row got one reward for every "
                        "sample (all right or all wrong), so none can train and the batch never fills",
                        "use data of a difficulty the model sometimes solves, a larger rollout.group_size, or "
                        "algo.dynamic_sampling_patience=0 to keep sampling regardless")
            self._cond.notify_all()
        assert self._wake is not None
        self._wake.set()

    def _wake_loop(self) -> None:
        if self._wake is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ------------------------------------------------------------------ trainer-facing API
    def submit(self, data: dict[str, Any], *, block: bool = True, timeout: float | None = None) -> None:
        """Queue one item for an episode. Blocks while the bounded input queue is full."""
        self._check_alive()
        try:
            self._input.put(data, block=block, timeout=timeout)
        except queue.Full:
            raise RolloutQueueFull(f"rollout input queue is full ({self.queue_size} items); "
                                   "raise rollout.queue_size or consume batches faster") from None
        self._wake_loop()

    def wait(self, count: int, timeout: float | None = None) -> Trajectory:
        """Block until ``count`` accepted episodes may be released; return them concatenated."""
        if count < 1:
            raise ValueError(f"wait(count={count}): count must be >= 1")
        most = (self.staleness.max_head_offpolicyness + 1) * self.batch_size
        if count > most:  # the capacity rule never lets that many be outstanding at one version
            raise ValueError(f"wait(count={count}) can never complete: at most (k + 1) * batch_size = {most} "
                             "episodes are admitted per version")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_failed()
                picked = self._pick(count)
                if picked is not None:
                    break
                if self._exiting.is_set():
                    raise RuntimeError("rollout executor was destroyed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"rollout wait: {len(self._ready)} ready / {count} needed after "
                                       f"{timeout}s ({len(self._running)} running)")
                self._cond.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))
            self._totals.consumed += count
        self._wake_loop()
        batch = Trajectory.concat([d.traj for d in picked], pad_id=self.pad_token_id)
        self._record_batch(batch)
        return batch

    def _pick(self, count: int) -> list[_Done] | None:
        oldest_running = min(self._running.values(), default=None)
        releasable = [d for d in self._ready if oldest_running is None or d.submit_version <= oldest_running]
        if len(releasable) < count:
            return None
        releasable.sort(key=lambda d: (d.submit_version, d.finished))
        picked = releasable[:count]
        ids = {d.seq for d in picked}
        self._ready = [d for d in self._ready if d.seq not in ids]
        return picked

    def _record_batch(self, batch: Trajectory) -> None:
        version = self.version_provider.get_version()
        stats = staleness_stats(batch, version)
        subs = batch.meta.get("submit_version", [])
        stats["staleness/episode_max"] = float(max((version - s for s in subs), default=0))
        stats["version"] = float(version)
        with self._cond:
            self._totals.batches += 1
            t = self._totals
            t.max_token_staleness = max(t.max_token_staleness, int(stats["staleness/max"]))
            self._totals.last_batch = stats

    def prepare_batch(self, dataloader: Iterable[Any], batch_size: int | None = None,
                      timeout: float | None = None) -> Trajectory:
        """Feed items from ``dataloader`` while there is capacity (plus one batch ahead) and return
        ``batch_size`` episodes. ``dataloader`` yields items (dicts) or lists of items. A re-iterable
        (list, DataLoader) is cycled over epochs; a one-shot iterator that runs dry raises DataError
        once nothing more can complete."""
        bs = self.batch_size if batch_size is None else int(batch_size)
        deadline = None if timeout is None else time.monotonic() + timeout
        feeder = self._feeder(dataloader)
        exhausted = False
        while True:
            self._raise_if_failed()
            if not exhausted:
                exhausted = self._feed(feeder, bs)
            try:
                return self.wait(bs, timeout=self._poll * 4)
            except TimeoutError:
                pass
            if exhausted and self._drained():
                raise DataError(f"the dataloader ran out: {len(self._ready)} episodes ready, {bs} needed — "
                                "pass a re-iterable dataloader (it is cycled) or a longer iterator")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"prepare_batch: no batch of {bs} within {timeout}s")

    def _feeder(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        key = id(dataloader)
        cached = self._data_iters.get(key)
        if cached is not None and cached[0] is dataloader:
            return cached[1]
        it = _cycle(dataloader) if not isinstance(dataloader, Iterator) else dataloader
        self._data_iters = {key: (dataloader, it)}
        return it

    def _feed(self, feeder: Iterator[Any], bs: int) -> bool:
        """Move items into the input queue up to capacity + one batch; True once the feeder is dry."""
        want = max(self.staleness.get_capacity(), 0) + bs
        while self._input.qsize() < want:
            if not self._overflow:
                try:
                    self._overflow.extend(_as_items(next(feeder)))
                except StopIteration:
                    return True
            try:
                self._input.put_nowait(self._overflow[0])
            except queue.Full:
                break
            self._overflow.popleft()
        self._wake_loop()
        return False

    def _drained(self) -> bool:
        with self._cond:
            return not self._running and not self._overflow and self._input.empty()

    def pause(self) -> None:
        """Stop admitting new episodes (running ones continue; servers are not touched)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._wake_loop()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def get_version(self) -> int:
        return self.version_provider.get_version()

    def set_version(self, version: int) -> None:
        """Advance the policy version. Call it only after every server holds version ``version``.

        Before the first episode is admitted it also re-bases the staleness count, so syncing a new
        executor to servers that are already at version ``v0`` does not open ``v0`` batches of capacity."""
        setter = getattr(self.version_provider, "set_version", None)
        if setter is None:
            raise TypeError(f"{type(self.version_provider).__name__} has no set_version(); advance the "
                            "external version provider instead")
        setter(int(version))
        self.staleness.rebase_if_idle(int(version))
        self._wake_loop()

    def run_coroutine(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the executor's loop (e.g. ``engine.pause_generation()``); return its result."""
        self._check_alive()
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout=timeout)

    def get_stats(self) -> dict[str, float]:
        s = self.staleness.stats
        with self._cond:
            t = self._totals
            out = {"rollout/submitted": s.submitted, "rollout/accepted": s.accepted,
                   "rollout/rejected": s.rejected, "rollout/running": s.running,
                   "rollout/failed": t.failed, "rollout/consumed": t.consumed,
                   "rollout/ready": len(self._ready), "rollout/queued": self._input.qsize(),
                   "rollout/capacity": self.staleness.get_capacity(),
                   "rollout/max_token_staleness": t.max_token_staleness}
            out.update({f"rollout/last_batch/{k}": v for k, v in t.last_batch.items()})
        return {k: float(v) for k, v in out.items()}

    @property
    def last_batch_stats(self) -> dict[str, float]:
        with self._cond:
            return dict(self._totals.last_batch)

    # ------------------------------------------------------------------ recovery
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs. ``accepted`` is saved as the *consumed* count: episodes that were
        ready or running at save time are lost with the process, so counting them would starve the
        resumed run of capacity."""
        s = self.staleness.stats
        with self._cond:
            consumed = self._totals.consumed
        return {"consumed": consumed, "version": self.version_provider.get_version(),
                "staleness": {"accepted": consumed, "submitted": s.submitted, "rejected": s.rejected,
                              "start_version": self.staleness.start_version}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts (before anything is submitted). Sets the version too when the provider is ours."""
        with self._cond:
            if self._running or self._ready or not self._input.empty():
                raise RuntimeError("load_state_dict must be called before any episode is submitted")
            self._totals.consumed = int(state["consumed"])
        self.staleness.load_state_dict(state["staleness"])
        if "version" in state and hasattr(self.version_provider, "set_version"):
            self.version_provider.set_version(int(state["version"]))  # type: ignore[attr-defined]
        self._wake_loop()

    # ------------------------------------------------------------------ lifecycle
    def destroy(self, timeout: float = 10.0) -> None:
        """Cancel running episodes, stop the loop and join the thread. Idempotent."""
        if self._exiting.is_set():
            return
        self._exiting.set()
        self._wake_loop()
        self._thread.join(timeout=timeout)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> "RolloutExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def _check_alive(self) -> None:
        if self._exiting.is_set() or not self._thread.is_alive():
            raise RuntimeError("rollout executor is not running (destroyed)")

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, ArealError):  # the user's to fix: their one line, not an episode crash
            raise self._error
        if self._error is not None:
            raise RolloutError(f"a rollout episode failed: {type(self._error).__name__}: {self._error}") \
                from self._error


def _initial_version(engine: Any) -> int:
    try:
        return int(engine.get_version())
    except Exception:  # noqa: BLE001 - an engine that cannot report a version starts at 0
        return 0


def _as_items(batch: Any) -> list[dict[str, Any]]:
    if isinstance(batch, dict):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return list(batch)
    raise DataError(f"the dataloader yielded a {type(batch).__name__}; "
                    "expected a dict item or a list of them")


def _cycle(iterable: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for x in iterable:
            empty = False
            yield x
        if empty:
            return
