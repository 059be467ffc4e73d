"""What every launcher (local, SLURM, SkyPilot, Ray) agrees on.

A launcher turns a validated plan into running processes. The plan is first flattened into a
:class:`JobLayout` (plain, JSON-serialisable): which inference servers run on which node with which
devices, and how many trainer ranks each node hosts. Launchers differ only in *how* they get a
process onto a node; what runs on one node is :func:`areal_cli.launchers.local.run_node`, except under
Ray, where each process is its own actor (:mod:`areal_cli.launchers.ray`).

Server addresses travel through the run dir (``<run_dir>/servers/<index>.json``, one record per
live server). It lives on the shared fileroot, so multi-node jobs see one address book, and the
trainer re-reads it to learn about restarted servers.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_cli.registry import Registry


@dataclass
class ServerSpec:
    """One inference server = one data-parallel instance of the inference allocation."""

    index: int
    backend: str = "hf"  # hf | vllm | sglang
    tp: int = 1
    pp: int = 1
    node: int = 0
    devices: list[int] = field(default_factory=list)  # device ids on its node (GPU ids; CPU: slots)

    @property
    def name(self) -> str:
        return f"server{self.index}"


@dataclass
class TrainerSpec:
    """The trainer job: ``world_size`` ranks over ``nnodes`` nodes (torchrun/srun)."""

    backend: str = "fsdp"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 0  # experts' tensor-parallel size (0: tp); set by the hybrid MoE form
    nnodes: int = 1
    nproc_per_node: int = 1
    first_node: int = 0  # trainer nodes are first_node .. first_node + nnodes - 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def node_ranks(self) -> list[int]:
        return list(range(self.first_node, self.first_node + self.nnodes))


@dataclass
class JobLayout:
    """The placement of one experiment onto ``n_nodes`` nodes."""

    n_nodes: int = 1
    device: str = "cpu"
    servers: list[ServerSpec] = field(default_factory=list)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    colocated: bool = False  # inference and training share devices (``|`` in allocation_mode)

    def servers_on(self, node: int) -> list[ServerSpec]:
        return [s for s in self.servers if s.node == node]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "JobLayout":
        return JobLayout(
            n_nodes=int(d.get("n_nodes", 1)), device=str(d.get("device", "cpu")),
            servers=[ServerSpec(**s) for s in d.get("servers", [])],
            trainer=TrainerSpec(**d.get("trainer", {})), colocated=bool(d.get("colocated", False)),
        )

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict())

    @staticmethod
    def load(path: str | os.PathLike) -> "JobLayout":
        return JobLayout.from_dict(json.loads(Path(path).read_text()))


@runtime_checkable
class Launcher(Protocol):
    """Starts one experiment's processes and supervises them until they end.

    ``launch`` returns the process exit code to propagate (0 on success) and raises
    :class:`areal_cli.errors.LaunchError` naming the failed process and its log tail.
    """

    name: str

    def preflight(self, cfg: Any, layout: JobLayout) -> None:
        """Raise :class:`areal_cli.errors.LaunchError` if this machine cannot launch the plan at all
        (missing cluster tools, too many nodes). Runs before the model and run dir are prepared."""

    def dry_run(self, cfg: Any, layout: JobLayout, run_dir: str) -> dict[str, Any] | None:
        """What a launch would submit (a script, a task file), for ``areal train --dry-run``; None
        when it submits nothing beyond the plan. Needs no cluster software."""

    def launch(self, cfg: Any, layout: JobLayout, run_dir: str, *, model_path: str | None = None,
               model_revision: str | None = None, on_tick: Callable[[], None] | None = None) -> int:
        """Every launcher takes the same arguments: ``model_path`` the model dir this machine resolved (a hub
        model fetched here), ``model_revision`` the pinned hub revision for launchers whose nodes fetch it
        themselves, ``on_tick`` called while the run is supervised from here (the live view). A launcher
        ignores what it has no use for."""
        ...


# The inference servers' api key, when a launcher binds them to a non-loopback address (launcher=ray): the
# hf server reads it from this variable, the trainer's inference client sends it.
SERVER_KEY_ENV = "AREAL_SERVER_API_KEY"
# The model dir a trainer rank loads, set by whoever fetched a hub model on the rank's node (the run dir's
# launch.json then names the hub id, which each node resolves into its own HF cache).
MODEL_PATH_ENV = "AREAL_MODEL_PATH"

@dataclass(frozen=True)
class LauncherEntry:
    """What a launcher declares in its registry: the fix when its module cannot be imported."""

    fix: str = "reinstall areal-cli"


# launcher.name → ("module:Class", what to do when its module cannot be imported); the registry below is
# declared from it (a plugin declares its own launcher there).
LAUNCHERS: dict[str, tuple[str, str]] = {
    "local": ("areal_cli.launchers.local:LocalLauncher", "reinstall areal-cli"),
    "slurm": ("areal_cli.launchers.slurm:SlurmLauncher", "install submitit or use launcher=local"),
    "skypilot": ("areal_cli.launchers.skypilot:SkyPilotLauncher",
                 "pip install 'areal-cli[skypilot]' or use launcher=local"),
    "ray": ("areal_cli.launchers.ray:RayLauncher", "reinstall areal-cli"),
}
LAUNCHER_REGISTRY: Registry = Registry("launcher", "launcher.name", LauncherEntry)
for _name, (_target, _fix) in LAUNCHERS.items():
    LAUNCHER_REGISTRY.declare(_name, _target, fix=_fix)


def get_launcher(name: str) -> Launcher:
    """The launcher registered under ``launcher.name``."""
    from areal_cli.errors import ConfigError

    entry = LAUNCHER_REGISTRY.entry(name)
    try:
        return entry.load()()
    except ImportError as e:
        raise ConfigError("launcher.name", f"the {name} launcher cannot be imported ({e})", entry.spec.fix) from e


# ---------------------------------------------------------------- a node's user error, for the submitting CLI

NODE_ERRORS = "node_errors"


def error_record(exc: BaseException) -> dict[str, Any]:
    """A user error as plain JSON: its type and fields (exceptions with their own constructor arguments, like
    ConfigError, do not survive pickling into another process)."""
    to_dict = getattr(exc, "to_dict", None)
    return {"type": type(exc).__name__, "message": str(exc),
            "details": list(getattr(exc, "details", None) or []), **(to_dict() if callable(to_dict) else {})}


def error_from_record(rec: dict[str, Any], where: str = "") -> Exception:
    """:func:`error_record` back into its :class:`~areal_cli.errors.ArealError` type (same one line)."""
    from areal_cli import errors

    cls = getattr(errors, str(rec.get("type")), None)
    if cls is errors.ConfigError:
        err: Exception = errors.ConfigError(rec.get("path", ""), rec.get("reason", ""), rec.get("hint", ""))
    elif isinstance(cls, type) and issubclass(cls, errors.ArealError):
        err = cls(rec.get("message", ""))
    else:
        err = errors.LaunchError(f"{where}{rec.get('message', '')}")
    if rec.get("details"):
        err.details = [str(d) for d in rec["details"]]  # type: ignore[attr-defined]
    return err


def record_node_error(run_dir: str | os.PathLike, node_rank: int, exc: BaseException) -> None:
    """Keep a node's :class:`~areal_cli.errors.ArealError` in the run dir, so the CLI that submitted the job
    (``launcher=slurm``) shows it as the same one typed line instead of the job's traceback."""
    write_json_atomic(Path(run_dir) / NODE_ERRORS / f"{node_rank}.json",
                      {"node": node_rank, **error_record(exc)})


def read_node_error(run_dir: str | os.PathLike) -> Exception | None:
    """The lowest node's recorded error, rebuilt as its type; None when no node recorded one."""
    for p in sorted((Path(run_dir) / NODE_ERRORS).glob("*.json"), key=lambda q: (len(q.stem), q.stem)):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        return error_from_record(rec, where=f"node {rec.get('node')}: ")
    return None


# ---------------------------------------------------------------- the run's state, for `areal status`

STATUS_FILE = "status.json"
HEARTBEAT_S = 10.0  # how often a supervising launcher refreshes status.json's heartbeat
TERMINAL_STATES = ("done", "failed", "interrupted")


def read_status_file(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``<run_dir>/status.json`` as a dict; {} when absent or being replaced."""
    try:
        rec = json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


class RunStatusWriter:
    """Keeps ``<run_dir>/status.json`` (fields: docs/train.md, "Looking at a run"): ``running`` with a
    heartbeat while a launcher supervises the run, then its final state. A reader on another machine
    cannot see the launcher's process, so a heartbeat older than a few intervals means the launcher died
    without recording an end; on the launcher's own host the recorded pid says the same at once."""

    def __init__(self, run_dir: str | os.PathLike, launcher: str, interval_s: float = HEARTBEAT_S,
                 **extra: Any):
        import socket
        import threading

        self.path = Path(run_dir) / STATUS_FILE
        self.interval_s = interval_s
        self.fields = {"launcher": launcher, "pid": os.getpid(), "host": socket.gethostname(), **extra}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Record ``running`` now and refresh the heartbeat from a daemon thread (a hub download or a slow
        server start blocks the launcher's own loop for minutes)."""
        import threading
        import time

        now = time.time()
        self.fields["started"] = now
        with self._lock:
            write_json_atomic(self.path, {"state": "running", "time": now, "heartbeat": now, **self.fields})
        self._thread = threading.Thread(target=self._beat, name="areal-status-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        import time

        while not self._stop.wait(self.interval_s):
            with self._lock:
                cur = read_status_file(self.path.parent)
                if self._stop.is_set() or cur.get("state") in TERMINAL_STATES:
                    return  # another node recorded the end
                write_json_atomic(self.path, {**cur, "state": "running", "heartbeat": time.time(),
                                              **self.fields})

    def end(self, state: str, error: str | None = None) -> None:
        """Record a final state (``done``, ``failed``, ``interrupted``), with a failure's first line."""
        import time

        self._stop.set()
        with self._lock:
            rec = {**read_status_file(self.path.parent), **self.fields}
            rec.pop("error", None)
            now = time.time()
            rec.update({"state": state, "time": now, "ended": now, "heartbeat": now})
            if error:
                rec["error"] = error.strip().splitlines()[0] if error.strip() else error
            write_json_atomic(self.path, rec)


# ---------------------------------------------------------------- the server address book

def servers_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "servers"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, p)


def publish_server(run_dir: str | os.PathLike, index: int, address: str, epoch: int, pid: int | None,
                   backend: str) -> None:
    """Record that server ``index`` serves at ``address``; ``epoch`` counts its restarts."""
    write_json_atomic(servers_dir(run_dir) / f"{index}.json",
                      {"index": index, "address": address, "epoch": epoch, "pid": pid, "backend": backend})


def retract_server(run_dir: str | os.PathLike, index: int) -> None:
    try:
        (servers_dir(run_dir) / f"{index}.json").unlink()
    except FileNotFoundError:
        pass


def read_servers(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Live server records, ordered by index."""
    out = []
    d = servers_dir(run_dir)
    if not d.is_dir():
        return out
    for p in d.glob("*.json"):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # a record being replaced; the next read sees it
    return sorted(out, key=lambda r: r["index"])


def wait_for_servers(run_dir: str | os.PathLike, want: int, timeout_s: float) -> list[dict[str, Any]]:
    """Block until ``want`` servers are published (the launcher starts them while the trainer boots)."""
    import time

    from areal_cli.errors import LaunchError

    deadline = time.time() + timeout_s
    recs = read_servers(run_dir)
    while len(recs) < want:
        if time.time() > deadline:
            raise LaunchError(f"{len(recs)} of {want} inference servers published an address under "
                              f"{run_dir}/servers within {timeout_s:.0f}s; start runs with `areal train`")
        time.sleep(0.2)
        recs = read_servers(run_dir)
    return recs
