"""The run's state for `areal status` (status.json, refreshed by a heartbeat) and a node's user error, carried
as plain JSON to the submitting CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal_cli.job.layout import write_json_atomic


# a node's user error, for the submitting CLI

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


# the run's state, for `areal status`

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
