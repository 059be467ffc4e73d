"""The staleness bound: how many episodes may be in flight for the current policy version.

With consumer batch size ``B`` (episodes per training step), staleness bound ``k``
(``max_head_offpolicyness``) and current policy version ``v``::

    capacity = min(max_concurrent - running, (k + v + 1) * B - (accepted + running))

``accepted`` is cumulative (it does not drop when the trainer consumes a batch), so the second term
says: "by the time the trainer reaches version ``v + k + 1`` it must have consumed everything that was
admitted while the version was ``v``". ``k = 0`` admits exactly ``B`` episodes per version, i.e.
synchronous RL. When counting starts at a later version ``v0`` (a new executor on a server already at
``v0``), ``v`` above is ``version - v0`` (``start_version``; 0 for a run that starts from scratch).

Rejected episodes (``should_accept`` false, or a workflow returning ``None``) are
not counted, so they free capacity and dynamic sampling never deadlocks.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from areal_cli.errors import ConfigError


@runtime_checkable
class VersionProvider(Protocol):
    """Anything that knows the current policy version (an inference client, a trainer, a counter)."""

    def get_version(self) -> int: ...


class VersionCounter:
    """A thread-safe settable version, the executor's default :class:`VersionProvider`."""

    def __init__(self, version: int = 0):
        self._version = int(version)
        self._lock = threading.Lock()

    def get_version(self) -> int:
        with self._lock:
            return self._version

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = int(version)


@dataclass
class RolloutStat:
    """Cumulative episode counts. ``running`` is the only non-cumulative field."""

    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    running: int = 0


class StalenessManager:
    """Capacity bookkeeping for the staleness bound; thread-safe."""

    def __init__(self, max_concurrent: int, max_head_offpolicyness: int, batch_size: int,
                 version_provider: VersionProvider, start_version: int = 0):
        _check_int("rollout.max_concurrent_rollouts", max_concurrent, 1)
        _check_int("rollout.max_head_offpolicyness", max_head_offpolicyness, 0)
        _check_int("algo.batch_size", batch_size, 1)
        if not isinstance(version_provider, VersionProvider):
            raise TypeError("version_provider must have get_version(); "
                            f"got {type(version_provider).__name__}")
        self.max_concurrent = int(max_concurrent)
        self.max_head_offpolicyness = int(max_head_offpolicyness)
        self.batch_size = int(batch_size)
        self.version_provider = version_provider
        self.start_version = int(start_version)
        self._stat = RolloutStat()
        self._lock = threading.Lock()

    def get_capacity(self, version: int | None = None) -> int:
        """Episodes that may be admitted now (may be negative after a restore with a lower version)."""
        v = self.version_provider.get_version() if version is None else int(version)
        with self._lock:
            s = self._stat
            concurrency = self.max_concurrent - s.running
            ahead = self.max_head_offpolicyness + v - self.start_version + 1
            staleness = ahead * self.batch_size - (s.accepted + s.running)
            return min(concurrency, staleness)

    def on_submit(self, n: int = 1) -> None:
        with self._lock:
            self._stat.submitted += n
            self._stat.running += n

    def on_accept(self, n: int = 1) -> None:
        with self._lock:
            self._finish(n)
            self._stat.accepted += n

    def on_reject(self, n: int = 1) -> None:
        with self._lock:
            self._finish(n)
            self._stat.rejected += n

    def _finish(self, n: int) -> None:
        if self._stat.running < n:
            raise RuntimeError(f"staleness bookkeeping: finishing {n} episodes but only "
                               f"{self._stat.running} are running")
        self._stat.running -= n

    def rebase_if_idle(self, version: int) -> bool:
        """Start counting at ``version`` if nothing was ever submitted or restored; True if re-based."""
        with self._lock:
            s = self._stat
            if s.submitted or s.accepted or s.rejected or s.running:
                return False
            self.start_version = int(version)
            return True

    @property
    def stats(self) -> RolloutStat:
        with self._lock:
            return RolloutStat(**asdict(self._stat))

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counts; ``running`` is not saved (in-flight episodes do not survive a restart)."""
        with self._lock:
            return {"submitted": self._stat.submitted, "accepted": self._stat.accepted,
                    "rejected": self._stat.rejected, "start_version": self.start_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            if self._stat.running:
                raise RuntimeError("cannot restore staleness state while episodes are running")
            self._stat = RolloutStat(submitted=int(state.get("submitted", state["accepted"])),
                                     accepted=int(state["accepted"]),
                                     rejected=int(state.get("rejected", 0)), running=0)
            self.start_version = int(state.get("start_version", 0))


def _check_int(path: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(path, f"must be an integer >= {minimum}, got {value!r}",
                          f"set {path}={max(minimum, 1)} or larger")
