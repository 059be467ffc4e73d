"""The run's inference servers as the trainer sees them: addresses, health, restart epochs.

The launcher publishes one record per server (``index``, ``address``, ``backend``, ``epoch``) and
bumps a server's ``epoch`` when it restarts it. A restarted server holds the base weights, so the
trainer must bring it to the current policy before routing to it again; :class:`ServerFleet` keeps
the epochs the trainer last synced and says which servers are behind. The RL loop
(``trainer/rl.py``) and the SFT loop (``trainer/sft.py``) share it; both hand it the launcher's record
readers and a client factory, so this folder imports neither the launchers nor the trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from areal_cli.api.inference_api import InferenceEngine

Records = list[dict[str, Any]]


class ServerFleet:
    """The servers of one run. ``read(run_dir)`` returns the live records; ``wait(run_dir, n, timeout_s)``
    blocks until ``n`` are published; ``connect(addresses, backend, tp_sizes)`` builds a client."""

    def __init__(self, run_dir: str, n_servers: int, startup_timeout_s: float, *,
                 read: Callable[[str], Records], wait: Callable[[str, int, float], Records],
                 connect: Callable[..., InferenceEngine]):
        self.run_dir, self.n_servers = run_dir, n_servers
        self.startup_timeout_s = float(startup_timeout_s)
        self._read, self._wait, self._connect = read, wait, connect
        self.epochs: dict[int, int] = {}  # server index -> epoch the trainer last brought up to date
        self.restarts_synced = 0
        # Bumped whenever a restarted server is brought back: the next distributed push then builds a
        # new weight-update group under a new name, which every server (the restarted one included) joins.
        self.group_epoch = 0
        self.client: InferenceEngine | None = None  # rank 0's control client: weight updates, health
        self.control: Any = None  # LoopRunner: the event loop thread that owns ``client``'s sessions
        self.listeners: list[Callable[[list[str]], None]] = []  # told the addresses after a restart

    # ------------------------------------------------------------------ records
    def wait(self) -> Records:
        """Every server's record; waits while the launcher is still starting them."""
        return self._wait(self.run_dir, max(1, self.n_servers), self.startup_timeout_s)

    def records(self) -> Records:
        return self._read(self.run_dir)

    def adopt(self, recs: Records) -> None:
        """Take ``recs``' epochs as synced (the servers already serve the trainer's weights)."""
        self.epochs = {r["index"]: r["epoch"] for r in recs}

    def pending(self) -> Records:
        """Servers restarted since we last synced them: they hold the base weights."""
        return [r for r in self.records() if self.epochs.get(r["index"]) != r["epoch"]]

    def complete(self) -> bool:
        """Whether every server is published again (a restarting one retracts its record)."""
        return len(self.records()) >= self.n_servers

    # ------------------------------------------------------------------ clients
    def client_for(self, recs: Records, tp_sizes: list[int] | int = 1) -> InferenceEngine:
        """A client for the servers of ``recs``."""
        return self._connect([r["address"] for r in recs], recs[0].get("backend", "hf"), tp_sizes)

    def open_control(self, tp_of_index: dict[int, int]) -> Records:
        """Rank 0: wait for the servers, take their epochs, build the control client and its loop."""
        from areal_cli.utils.concurrency import LoopRunner

        recs = self.wait()
        self.adopt(recs)
        self.client = self.client_for(recs, [tp_of_index.get(r["index"], 1) for r in recs])
        self.control = LoopRunner()
        return recs

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a control coroutine (weight load, health check) on the control loop."""
        return self.control.run(coro, timeout)

    @property
    def loop(self) -> Any:
        """The control loop: it owns the control client's HTTP sessions."""
        return self.control.loop if self.control is not None else None

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None

    # ------------------------------------------------------------------ restarts
    def rejoin(self, recs: Records, what: str, version: int) -> None:
        """``recs`` (restarted servers) now hold ``version``: route to them again."""
        for rec in recs:
            self.epochs[rec["index"]] = rec["epoch"]
            print(f"[areal] server {rec['index']} came back at {rec['address']}; loaded {what}{version}",
                  flush=True)
        addresses = [r["address"] for r in self.records() if r["index"] in self.epochs]
        self.client.set_addresses(addresses)
        for tell in self.listeners:
            tell(addresses)
        self.restarts_synced += 1

    def await_restart(self) -> Records | None:
        """After a failed request: the servers' records once one that the launcher restarted (an epoch
        other than :attr:`epochs`) is published and all servers are; ``None`` at once when every server
        answers its health check (the failure was something else), or at the start-up timeout."""
        deadline = time.monotonic() + self.startup_timeout_s

        def restarted(recs: Records) -> bool:
            return any(self.epochs.get(r["index"]) != r["epoch"] for r in recs)

        recs = self.records()
        # A retracted record means the launcher is restarting that server: wait for it.
        if not restarted(recs) and len(recs) >= self.n_servers:
            if all(asyncio.run(self.client_for(recs).check_health()).values()):
                return None
        while time.monotonic() < deadline:
            recs = self.records()
            if restarted(recs) and len(recs) >= self.n_servers:
                return recs
            time.sleep(0.5)
        return None
