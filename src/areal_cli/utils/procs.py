"""Child processes that never outlive their parent: own process groups, group kills, log tails.

Every child is started in a new session (``start_new_session=True``) so that one ``killpg`` reaches
the child and everything it spawned (torchrun's workers, a server's tokenizer threads, ...), and so
that a Ctrl-C in the terminal reaches only the supervisor, which then stops the children in order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ManagedProcess:
    """A child process with its own process group and log file."""

    name: str
    argv: list[str]
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    # Under a supervisor that can be SIGKILLed (a Ray actor killed by `ray.kill` or with its node):
    # the kernel then kills this child too (PR_SET_PDEATHSIG), so no server or rank outlives it.
    die_with_parent: bool = False

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self) -> "ManagedProcess":
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ)
        full_env.update(self.env)
        log = open(self.log_path, "ab", buffering=0)
        try:
            log.write(f"\n===== start {self.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(self.argv)}\n".encode())
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=full_env, cwd=self.cwd,
                                          start_new_session=True,
                                          preexec_fn=_die_with_parent if self.die_with_parent else None)
        finally:
            log.close()  # the child holds its own descriptor
        self.started_at = time.time()
        return self

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the whole group, then SIGKILL after ``timeout``. Returns the exit code."""
        if self.popen is None:
            return None
        kill_group(self.popen, timeout=timeout)
        return self.popen.returncode

    def tail(self, n: int = 30) -> str:
        return tail_file(self.log_path, n)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL me when the thread that forked me exits (Linux only)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def kill_group(popen: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate ``popen``'s process group: SIGTERM, wait, SIGKILL. Reaps the leader."""
    pgid = _pgid(popen)
    if pgid is not None:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if popen.poll() is not None and (pgid is None or not _group_alive(pgid)):
            break
        time.sleep(0.05)
    if pgid is not None and _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    try:
        popen.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a D-state process
        pass
    if pgid is not None:
        # Grandchildren may linger briefly after SIGKILL of the leader; wait them out.
        end = time.time() + 5
        while _group_alive(pgid) and time.time() < end:
            _signal_group(pgid, signal.SIGKILL)
            time.sleep(0.05)


def _pgid(popen: subprocess.Popen) -> int | None:
    # With start_new_session the group id equals the leader pid, even after the leader is reaped.
    return popen.pid


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return _group_has_live_members(pgid)


def _group_has_live_members(pgid: int) -> bool:
    """True if some non-zombie process is in group ``pgid`` (zombies still answer killpg(0))."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return True
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return False


def tail_file(path: str | os.PathLike, n: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last ``n`` lines of a (possibly large) text file, or '' when it does not exist."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


def describe_exit(code: int | None) -> str:
    """'exit code 1' / 'killed by SIGKILL' for a Popen return code."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def freeze_heap() -> None:
    """Move every object alive now (model, tokenizer, datasets, imported modules) out of the cyclic
    garbage collector's reach. They live for the whole process; left in, each full collection
    rescans them, and in a trainer or server process that took 0.2–0.3 s, stalling a step or a
    decode batch several times per run."""
    import gc

    gc.collect()
    gc.freeze()


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None):
    """A ``preexec_fn`` that has the kernel send the child ``sig`` when the process that started it
    dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``; ``None`` elsewhere). A child in its own
    session is out of reach of its parent's group kill, so without this it would run on as an orphan.
    Start the child from a thread that lives as long as the parent (the signal follows the thread).
    ``parent``: the parent's pid when the returned function is built in the child itself (a spawned
    multiprocessing worker calls it first thing); by default, this process."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child runs only the call
    parent = os.getpid() if parent is None else int(parent)

    def _set() -> None:
        prctl(1, int(sig))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)

    return _set


@contextlib.contextmanager
def handling_stop_signals(handler):
    """SIGINT and SIGTERM go to ``handler`` while the block runs, then the previous handlers come back.
    Only the main thread can install handlers; elsewhere the block runs with the process's own."""
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            installed.append((sig, signal.signal(sig, handler)))
    try:
        yield
    finally:
        for sig, old in installed:
            signal.signal(sig, old)
