"""What one rollout episode means to the trainer: a seeded, retried run of the user's workflow.

- :class:`EpisodeRunner` wraps the workflow: it tags each trajectory with its prompt position and
  re-runs an episode whose server died under it (no prompt lost, none duplicated).
- :class:`SeededEngine` gives every sampling request a seed derived from the run seed and the prompt
  position, so an episode's tokens do not depend on batching, retries or resumption (exact resume).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from areal_cli.rollout.data_stream import position


class EpisodeRunner:
    """Wraps the user's workflow: tags each trajectory with its prompt position
    (:attr:`Trajectory.positions`) and re-runs an episode whose server died under it.

    A failed episode is discarded whole and run again from its prompt (on whichever server the
    client routes to), so a server crash loses no prompt and duplicates none. Retries continue for
    ``retry_window_s`` (long enough for the launcher to restart a server); other errors surface.
    """

    def __init__(self, inner: Any, retry_window_s: float = 300.0, wait_s: float = 1.0, seed: int = 0):
        self.inner = inner
        self.seed = int(seed)
        self.retry_window_s = retry_window_s
        self.wait_s = wait_s
        self.retried = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        import asyncio

        deadline = time.monotonic() + self.retry_window_s
        while True:
            try:
                pos = position(data)
                seeded = SeededEngine(engine, (self.seed * 1_000_003 + pos) * 4096) if pos is not None else engine
                traj = await self.inner.arun_episode(seeded, data)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - only transport failures are retried
                if time.monotonic() > deadline or not is_transport_error(e):
                    raise
                self.retried += 1
                await asyncio.sleep(self.wait_s)
        if traj is not None:
            traj.positions = [position(data)]
        return traj


class SeededEngine:
    """Gives the k-th sampling request of an episode the seed ``base + k``.

    The seed depends only on the run seed, the prompt's stream position and the request's order
    within the episode, so an episode produces the same tokens however requests are batched on the
    server, when it is re-run after a server crash, and in a resumed run (exact resume).
    """

    def __init__(self, inner: Any, base: int):
        self._inner = inner
        self._base = int(base) % (2**62)
        self._k = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _seeded(self, req: Any) -> Any:
        g = req.gconfig
        if getattr(g, "seed", None) is None and not g.greedy:
            req = dataclasses.replace(req, gconfig=g.new(seed=self._base + self._k))
        self._k += 1
        return req

    async def agenerate(self, req: Any) -> Any:
        return await self._inner.agenerate(self._seeded(req))

    async def agenerate_group(self, reqs: list[Any]) -> list[Any]:
        import asyncio

        reqs = [self._seeded(r) for r in reqs]
        group = getattr(self._inner, "agenerate_group", None)
        if group is None:
            return list(await asyncio.gather(*(self._inner.agenerate(r) for r in reqs)))
        return await group(reqs)


def is_transport_error(e: BaseException) -> bool:
    """Connection-level failures (a dead or restarting server), not bad requests or bugs. A request the
    server refused (4xx, e.g. longer than its context) is not retried: it would be refused again, and
    the run would wait out the retry window with nothing to show."""
    from areal_cli.errors import InferenceError
    from areal_cli.inference.client import RequestRejected

    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, RequestRejected):
            return False
        if isinstance(e, (ConnectionError, TimeoutError, OSError, InferenceError)):
            return True
        name = type(e).__module__ + "." + type(e).__name__
        if name.startswith(("httpx.", "aiohttp.", "httpcore.")):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
        seen += 1
    return False
