"""Run reward functions asynchronously in worker processes, each call bounded by a timeout.

Workers are started with ``spawn`` (or ``forkserver``), never ``fork``: the trainer process runs
threads. Each worker serves one call at a time over a pipe. A call that raises, hangs past
``timeout_s`` (its worker is killed and replaced), kills its worker, or returns something that is
not a finite number yields reward 0.0 and is counted in :attr:`AsyncRewardRunner.stats`; nothing
propagates to the caller. A result that states its correctness (:class:`~areal_cli.rewards.outcome.Reward`
or a bool) keeps it; a failed call is 0.0 with unknown correctness.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import multiprocessing as mp
import shutil
import signal
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable

from areal_cli.rewards.outcome import as_outcome, correctness

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class RewardStats:
    ok: int = 0
    error: int = 0
    timeout: int = 0
    garbage: int = 0

    @property
    def total(self) -> int:
        return self.ok + self.error + self.timeout + self.garbage

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _resolve(spec: "str | Callable[..., Any]") -> Callable[..., Any]:
    if isinstance(spec, str):
        from areal_cli.rewards.registry import get_reward_fn

        return get_reward_fn(spec)
    return spec


def _worker_main(conn, spec, tmp_root: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Temp files (e.g. code sandboxes) live under a per-worker dir the parent removes on kill.
    tempfile.tempdir = tmp_root
    try:
        fn = _resolve(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        args, kwargs = msg
        try:
            out = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - a reward must never take the worker down
            out = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(out)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("garbage", f"unpicklable result: {e!r}"))


def as_reward(value: Any) -> float | None:
    """A finite float from bool/int/float/numpy/0-d tensor results; None for anything else."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class _Worker:
    def __init__(self, ctx, spec):
        self.conn, child = ctx.Pipe()
        self.tmp_root = tempfile.mkdtemp(prefix="areal_reward_")
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, self.tmp_root), daemon=True,
                                name="areal-reward")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()
        shutil.rmtree(self.tmp_root, ignore_errors=True)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, EOFError, BrokenPipeError):
            pass
        self.proc.join(timeout=2)
        self.kill()


async def _recv(conn, timeout: float) -> Any:
    """Await one message on ``conn`` without blocking the event loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    fd = conn.fileno()

    def on_readable() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await asyncio.wait_for(fut, timeout)
    finally:
        loop.remove_reader(fd)
    return conn.recv()


class AsyncRewardRunner:
    """``await runner(prompt, completion, answer, **kw) -> float`` on a pool of worker processes.

    ``fn`` is a reward name for :func:`get_reward_fn` or a picklable (module-level) callable.
    """

    def __init__(self, fn: "str | Callable[..., Any]", max_workers: int = 2, timeout_s: float = 15.0,
                 start_method: str = "spawn"):
        if start_method not in ("spawn", "forkserver"):
            raise ValueError("reward workers must start with 'spawn' or 'forkserver' (the trainer has threads)")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if isinstance(fn, str):
            _resolve(fn)  # fail fast with a ConfigError naming workflow.reward
        self.spec = fn
        self.max_workers = max_workers
        self.timeout_s = float(timeout_s)
        self.stats = RewardStats()
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=20)
        self._ctx = mp.get_context(start_method)
        self._idle: list[_Worker] = [_Worker(self._ctx, fn) for _ in range(max_workers)]
        self._all: set[_Worker] = set(self._idle)
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.max_workers), loop
        return self._sem

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self._all.discard(w)
        nw = _Worker(self._ctx, self.spec)
        self._all.add(nw)
        return nw

    async def _ensure_ready(self, w: _Worker) -> _Worker:
        if w.ready:
            return w
        kind, payload = await _recv(w.conn, _STARTUP_TIMEOUT_S)
        if kind != "ready":
            raise RuntimeError(f"reward worker failed to start: {payload}")
        w.ready = True
        return w

    def _fail(self, kind: str, msg: str) -> float:
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.recent_errors.append(f"{kind}: {msg}")
        logger.debug("reward %s: %s", kind, msg)
        return 0.0

    async def __call__(self, prompt: str, completion: str, answer: str, **kw: Any) -> float:
        if self._closed:
            raise RuntimeError("AsyncRewardRunner is closed")
        async with self._semaphore():
            w = self._idle.pop()
            try:
                w = await self._ensure_ready(w)
                w.conn.send(((prompt, completion, answer), kw))
                kind, payload = await _recv(w.conn, self.timeout_s)
            except asyncio.TimeoutError:
                w = self._replace(w)
                return self._fail("timeout", f"no result after {self.timeout_s:.1f}s")
            except (EOFError, OSError, BrokenPipeError, RuntimeError) as e:
                w = self._replace(w)
                return self._fail("error", f"worker died: {e!r}")
            except asyncio.CancelledError:
                w = self._replace(w)  # the worker may still be computing: never reuse it
                raise
            finally:
                self._idle.append(w)
        if kind == "ok":
            val = as_reward(payload)
            if val is None:
                return self._fail("garbage", f"not a finite number: {payload!r:.200}")
            self.stats.ok += 1
            return as_outcome(payload) if correctness(payload) is not None else val
        return self._fail("garbage" if kind == "garbage" else "error", str(payload))

    async def score_many(self, items: list[tuple[str, str, str]], **kw: Any) -> list[float]:
        return list(await asyncio.gather(*(self(p, c, a, **kw) for p, c, a in items)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._all):
            w.stop()
        self._all.clear()
        self._idle.clear()

    def __enter__(self) -> "AsyncRewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncRewardRunner":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
