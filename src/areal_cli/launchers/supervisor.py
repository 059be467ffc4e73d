"""Inference-server supervision, one policy for every launcher that runs servers itself.

The per-node runner (``launcher=local``, and every SLURM or SkyPilot node through
:class:`~areal_cli.launchers.local.NodeRunner`) and the Ray driver (:class:`~areal_cli.launchers.ray.RayJob`)
start servers differently (a child process group; a Ray actor in a placement-group bundle) but supervise
them the same way: a server is published in the run dir's address book, with its ``epoch``, once it
answers its health check; a server that dies is retracted, stopped and started again on a fresh port
under ``epoch + 1`` (up to ``launcher.max_server_restarts``), so the trainer (``weight_sync/fleet.py``)
knows it holds the base weights. Each launcher supplies only the hooks: how to spawn, probe, stop and
describe one server, and how its trainer is checked while a server starts.
"""

from __future__ import annotations

import abc
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

from areal_cli.errors import LaunchError
from areal_cli.job.address_book import publish_server, retract_server
from areal_cli.job.layout import ServerSpec

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


class SupervisedServer(Protocol):
    """What the supervisor reads of one started server (the launcher's own record of it)."""

    name: str
    spec: ServerSpec | None
    epoch: int
    address: str | None
    pid: int | None


class ServerSupervisor(abc.ABC):
    """Start, publish and restart inference servers. Subclasses set ``cfg``, ``run_dir``, ``servers``
    (index -> the server's record), ``restarts`` and ``_signal`` (the stop signal received, if any)."""

    cfg: ExperimentConfig
    run_dir: str
    servers: dict[int, Any]
    restarts: int
    _signal: int | None

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _spawn_server(self, spec: ServerSpec, epoch: int) -> SupervisedServer:
        """Start ``spec``'s server under ``epoch`` (without waiting); record it in ``servers``."""

    @abc.abstractmethod
    def _server_exit(self, p: SupervisedServer) -> str | None:
        """Why the server is gone ('killed by SIGKILL', ...), or None while it runs."""

    @abc.abstractmethod
    def _server_healthy(self, p: SupervisedServer) -> bool:
        """Whether the server answers its health check."""

    @abc.abstractmethod
    def _stop_server(self, p: SupervisedServer) -> None: ...

    @abc.abstractmethod
    def _check_workers(self) -> bool:
        """True once the trainer finished; raises if it failed (checked while a server starts)."""

    @abc.abstractmethod
    def _server_failed(self, p: SupervisedServer, why: str) -> LaunchError:
        """The error of a server that died while starting."""

    @abc.abstractmethod
    def _server_not_ready(self, p: SupervisedServer) -> LaunchError:
        """The error of a server that did not answer within ``launcher.server_startup_timeout_s``."""

    @abc.abstractmethod
    def _out_of_restarts(self, p: SupervisedServer, why: str, limit: int) -> LaunchError:
        """The error of a server that died with no restart left."""

    @abc.abstractmethod
    def _restart_line(self, p: SupervisedServer, why: str, limit: int) -> str:
        """The line printed when a dead server is restarted."""

    def _after_restart(self) -> None:
        """Called once a restarted server is published (e.g. to rewrite a placement record)."""

    # ------------------------------------------------------------------ shared policy
    def _check_signal(self) -> None:
        if self._signal is not None:
            raise KeyboardInterrupt(signal.Signals(self._signal).name)

    def _wait_ready(self, p: SupervisedServer) -> None:
        """Wait until ``p`` answers its health check, then publish it with its epoch."""
        deadline = time.time() + float(self.cfg.launcher.server_startup_timeout_s)
        while time.time() < deadline:
            self._check_signal()
            self._check_workers()
            why = self._server_exit(p)
            if why is not None:
                raise self._server_failed(p, why)
            if self._server_healthy(p):
                publish_server(self.run_dir, p.spec.index, p.address, p.epoch, p.pid, p.spec.backend)
                return
            time.sleep(0.25)
        raise self._server_not_ready(p)

    def _restart_server(self, p: SupervisedServer, why: str) -> None:
        retract_server(self.run_dir, p.spec.index)
        self._stop_server(p)
        limit = int(self.cfg.launcher.max_server_restarts)
        if not self.cfg.launcher.restart_dead_servers or self.restarts >= limit:
            raise self._out_of_restarts(p, why, limit)
        self.restarts += 1
        print(self._restart_line(p, why, limit), file=sys.stderr, flush=True)
        new = self._spawn_server(p.spec, p.epoch + 1)
        self._wait_ready(new)
        self._after_restart()

    def _supervise_servers(self) -> None:
        """Restart every server of this supervisor that died."""
        for p in list(self.servers.values()):
            why = self._server_exit(p)
            if why is not None:
                self._restart_server(p, why)
