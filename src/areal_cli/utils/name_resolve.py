"""Name resolution across nodes: server addresses, rendezvous endpoints, weight-update notices.

A name is a slash-separated key (``exp/trial/rendezvous/master``); its value is a string.
Two backends share one interface:

- :class:`FileNameRecordRepository` (default): one JSON record per name under a directory on the
  shared fileroot. Writes are atomic (tmp + rename). A record expires when its owner dies:
  immediately when the owner ran on the reader's host and its pid is gone (pid + start time, so a
  reused pid does not count), and after ``keepalive_ttl`` seconds without a refresh otherwise —
  a background thread in the owner refreshes it every ``ttl / 3``.
- :class:`EtcdNameRecordRepository`: etcd v3 through its JSON gateway (``/v3/kv/*``,
  ``/v3/lease/*``); records with a TTL are attached to a lease the owner keeps alive, so etcd drops
  them when the owner stops refreshing. No client library beyond httpx is needed.

Records added with ``delete_on_exit=True`` are removed by :meth:`reset`, which runs at exit.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from areal_cli.errors import ArealError


class NameEntryNotFoundError(ArealError):
    """No live record under this name."""


class NameEntryExistsError(ArealError):
    """A live record already holds this name (pass replace=True to overwrite)."""


def _host_key() -> str:
    """Identifies a pid namespace on one boot of one host: where a pid check means something."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}:{boot}:{pidns}"


def _proc_start(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - psutil missing or the process is gone
        return None


def _pid_alive(pid: int, start: float | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start is None:
        return True
    now_start = _proc_start(pid)
    return now_start is None or abs(now_start - start) < 1.0


class NameRecordRepository:
    """The interface; see the module docstring."""

    def add(self, name: str, value: str, *, keepalive_ttl: float | None = None, replace: bool = False,
            delete_on_exit: bool = True) -> None:
        raise NotImplementedError

    def add_subentry(self, name: str, value: str, **kw: Any) -> str:
        """Add ``value`` under a fresh child of ``name``; returns the child's full name."""
        sub = f"{name.rstrip('/')}/{uuid.uuid4().hex[:12]}"
        self.add(sub, value, **kw)
        return sub

    def get(self, name: str) -> str:
        raise NotImplementedError

    def find_subtree(self, name_root: str) -> list[str]:
        """Names of live records at or below ``name_root``, sorted."""
        raise NotImplementedError

    def get_subtree(self, name_root: str) -> list[str]:
        """Values of live records below ``name_root``, in name order."""
        out = []
        for n in self.find_subtree(name_root):
            try:
                out.append(self.get(n))
            except NameEntryNotFoundError:
                continue
        return out

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def clear_subtree(self, name_root: str) -> None:
        for n in self.find_subtree(name_root):
            try:
                self.delete(n)
            except NameEntryNotFoundError:
                pass

    def wait(self, name: str, timeout: float | None = None, poll_s: float = 0.1) -> str:
        """Block until ``name`` has a live record; raises TimeoutError naming it."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            try:
                return self.get(name)
            except NameEntryNotFoundError:
                if deadline is not None and time.time() > deadline:
                    raise TimeoutError(f"no record for {name!r} after {timeout}s") from None
                time.sleep(poll_s)

    def reset(self) -> None:
        """Delete the records this repository added with ``delete_on_exit``; stop keepalives."""
        raise NotImplementedError


class _Keepalive:
    """One daemon thread that calls ``fn`` every ``period`` seconds until stopped."""

    def __init__(self, fn, period: float):
        self.fn, self.period = fn, period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="name-resolve-keepalive")
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self.fn()
            except Exception:  # noqa: BLE001 - a missed refresh is retried next period
                pass


class FileNameRecordRepository(NameRecordRepository):
    ENTRY = "ENTRY"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.expanduser(str(root)))
        self.root.mkdir(parents=True, exist_ok=True)
        self._mine: dict[str, float | None] = {}  # name -> ttl
        self._to_delete: set[str] = set()
        self._lock = threading.Lock()
        self._host = _host_key()
        self._start = _proc_start(os.getpid())
        self._keepalive: _Keepalive | None = None
        atexit.register(self.reset)

    def _path(self, name: str) -> Path:
        parts = [p for p in name.strip("/").split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"invalid name {name!r}")
        return self.root.joinpath(*parts) / self.ENTRY

    def _record(self, value: str, ttl: float | None) -> dict[str, Any]:
        return {"value": value, "pid": os.getpid(), "start": self._start, "host": self._host,
                "ttl": ttl, "expires_at": (time.time() + ttl) if ttl else None, "written": time.time()}

    def _write(self, path: Path, rec: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{self.ENTRY}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)

    def _live(self, rec: dict[str, Any]) -> bool:
        exp = rec.get("expires_at")
        if exp is not None and time.time() > exp:
            return False
        if rec.get("host") == self._host and rec.get("pid") is not None:
            return _pid_alive(int(rec["pid"]), rec.get("start"))
        return True

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not self._live(rec):
            try:  # garbage-collect, unless the owner rewrote it meanwhile
                if json.loads(path.read_text()).get("written") == rec.get("written"):
                    path.unlink()
            except (OSError, ValueError):
                pass
            return None
        return rec

    def add(self, name: str, value: str, *, keepalive_ttl: float | None = None, replace: bool = False,
            delete_on_exit: bool = True) -> None:
        import fcntl

        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = path.with_name(".lock")
        with open(lock_path, "a") as lk:
            fcntl.lockf(lk, fcntl.LOCK_EX)  # check-then-write must not interleave with another adder
            try:
                if not replace and self._read(path) is not None:
                    raise NameEntryExistsError(f"name {name!r} is held by a live record; pass replace=True")
                self._write(path, self._record(str(value), keepalive_ttl))
            finally:
                fcntl.lockf(lk, fcntl.LOCK_UN)
        with self._lock:
            self._mine[name] = keepalive_ttl
            if delete_on_exit:
                self._to_delete.add(name)
            ttls = [t for t in self._mine.values() if t]
            if ttls and self._keepalive is None:
                self._keepalive = _Keepalive(self._refresh, min(ttls) / 3)
            elif ttls and self._keepalive is not None:
                self._keepalive.period = min(ttls) / 3

    def _refresh(self) -> None:
        with self._lock:
            items = list(self._mine.items())
        for name, ttl in items:
            if not ttl:
                continue
            path = self._path(name)
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("pid") != os.getpid() or rec.get("host") != self._host:
                continue  # someone replaced it: no longer ours
            rec["expires_at"] = time.time() + ttl
            self._write(path, rec)

    def get(self, name: str) -> str:
        rec = self._read(self._path(name))
        if rec is None:
            raise NameEntryNotFoundError(f"no live record for {name!r} under {self.root}")
        return str(rec["value"])

    def find_subtree(self, name_root: str) -> list[str]:
        base = self._path(name_root).parent
        if not base.is_dir():
            return []
        out = []
        for p in base.rglob(self.ENTRY):
            if self._read(p) is not None:
                out.append(str(p.parent.relative_to(self.root)).replace(os.sep, "/"))
        return sorted(out)

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise NameEntryNotFoundError(f"no record for {name!r}") from None
        with self._lock:
            self._mine.pop(name, None)
            self._to_delete.discard(name)

    def reset(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop.set()
            self._keepalive = None
        with self._lock:
            names = list(self._to_delete)
        for n in names:
            try:
                rec = json.loads(self._path(n).read_text())
                if rec.get("pid") == os.getpid() and rec.get("host") == self._host:
                    self._path(n).unlink()
            except (OSError, ValueError):
                pass
        with self._lock:
            self._to_delete.clear()
            self._mine.clear()


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _prefix_end(key: bytes) -> bytes:
    """etcd's range_end for "every key starting with ``key``"."""
    b = bytearray(key)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


class EtcdNameRecordRepository(NameRecordRepository):
    """etcd v3 via its JSON gateway; TTL records ride on one lease per TTL value."""

    def __init__(self, endpoint: str = "127.0.0.1:2379", prefix: str = "/areal/", timeout: float = 5.0):
        import httpx

        self.base = endpoint if endpoint.startswith("http") else f"http://{endpoint}"
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.http = httpx.Client(base_url=self.base, timeout=timeout)
        self._leases: dict[float, int] = {}
        self._to_delete: set[str] = set()
        self._lock = threading.Lock()
        self._keepalive: _Keepalive | None = None
        try:
            self._post("/v3/maintenance/status", {})
        except Exception as e:  # noqa: BLE001
            raise ArealError(f"cannot reach etcd at {self.base} ({e}) — fix: start etcd or set "
                             "cluster.etcd_endpoint, or use cluster.name_resolve=file") from e
        atexit.register(self.reset)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        r.raise_for_status()
        return r.json()

    def _key(self, name: str) -> str:
        return self.prefix + name.strip("/")

    def _lease(self, ttl: float) -> int:
        with self._lock:
            if ttl in self._leases:
                return self._leases[ttl]
        lid = int(self._post("/v3/lease/grant", {"TTL": max(1, int(round(ttl)))})["ID"])
        with self._lock:
            self._leases[ttl] = lid
            period = max(0.2, min(self._leases) / 3)
            if self._keepalive is None:
                self._keepalive = _Keepalive(self._refresh, period)
            else:
                self._keepalive.period = period
        return lid

    def _refresh(self) -> None:
        with self._lock:
            ids = list(self._leases.values())
        for lid in ids:
            self._post("/v3/lease/keepalive", {"ID": lid})

    def add(self, name: str, value: str, *, keepalive_ttl: float | None = None, replace: bool = False,
            delete_on_exit: bool = True) -> None:
        key = _b64(self._key(name))
        put: dict[str, Any] = {"key": key, "value": _b64(str(value))}
        if keepalive_ttl:
            put["lease"] = str(self._lease(keepalive_ttl))
        if replace:
            self._post("/v3/kv/put", put)
        else:
            # create_revision == 0 means "key absent": the put happens only if nobody holds the name.
            res = self._post("/v3/kv/txn", {
                "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": put}]})
            if not res.get("succeeded"):
                raise NameEntryExistsError(f"name {name!r} is held by a live record; pass replace=True")
        if delete_on_exit:
            with self._lock:
                self._to_delete.add(name)

    def get(self, name: str) -> str:
        kvs = self._post("/v3/kv/range", {"key": _b64(self._key(name))}).get("kvs", [])
        if not kvs:
            raise NameEntryNotFoundError(f"no live record for {name!r} in etcd at {self.base}")
        return base64.b64decode(kvs[0]["value"]).decode() if "value" in kvs[0] else ""

    def find_subtree(self, name_root: str) -> list[str]:
        root = self._key(name_root).encode()
        kvs = self._post("/v3/kv/range", {"key": _b64(root), "range_end": _b64(_prefix_end(root)),
                                          "keys_only": True}).get("kvs", [])
        names = []
        for kv in kvs:
            k = base64.b64decode(kv["key"]).decode()
            rest = k[len(root):]
            if rest == "" or rest.startswith("/"):  # "a/b" must not match "a/bc"
                names.append(k[len(self.prefix):])
        return sorted(names)

    def delete(self, name: str) -> None:
        res = self._post("/v3/kv/deleterange", {"key": _b64(self._key(name))})
        if int(res.get("deleted", 0)) == 0:
            raise NameEntryNotFoundError(f"no record for {name!r}")
        with self._lock:
            self._to_delete.discard(name)

    def reset(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop.set()
            self._keepalive = None
        with self._lock:
            names, leases = list(self._to_delete), list(self._leases.values())
            self._to_delete.clear()
            self._leases.clear()
        try:
            for n in names:
                self._post("/v3/kv/deleterange", {"key": _b64(self._key(n))})
            for lid in leases:
                self._post("/v3/lease/revoke", {"ID": lid})
        except Exception:  # noqa: BLE001 - etcd gone at exit: the leases expire on their own
            pass


def make_repository(cluster_cfg: Any) -> NameRecordRepository:
    """The repository ``cluster.name_resolve`` selects (records under ``<fileroot>/name_resolve``)."""
    from areal_cli.errors import ConfigError

    kind = str(getattr(cluster_cfg, "name_resolve", "file"))
    if kind == "file":
        return FileNameRecordRepository(os.path.join(os.path.expanduser(cluster_cfg.fileroot), "name_resolve"))
    if kind == "etcd":
        return EtcdNameRecordRepository(cluster_cfg.etcd_endpoint)
    raise ConfigError("cluster.name_resolve", f"unknown backend {kind!r}", "use file or etcd")
