"""Checks on one local or network-mounted path, run on the node where the path is used.

Every probe writes only inside ``<path>/.areal_storage_probe/`` and removes what it wrote.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from areal_cli.storage.report import FAIL, PASS, WARN, CheckResult, human_bytes

PROBE_DIR = ".areal_storage_probe"

# Filesystems whose contents other nodes can see. Matched against /proc/mounts' type field
# (``fuse.<name>`` entries are matched by their suffix as well).
NETWORK_FS = {
    "nfs", "nfs4", "lustre", "gpfs", "ceph", "cephfs", "juicefs", "beegfs", "cifs", "smb3", "smbfs",
    "glusterfs", "wekafs", "panfs", "orangefs", "pvfs2", "ocfs2", "gfs2", "afs", "sshfs", "s3fs",
    "goofys", "gcsfuse", "lizardfs", "moosefs", "mfs", "quobyte", "virtiofs", "9p", "dcfs", "alluxio",
}

# Only warnings: a slow filesystem still works, it just costs checkpoint time.
FSYNC_WARN_S = 0.1
WRITE_WARN_BPS = 50 * 1024 * 1024


@dataclass
class MountInfo:
    mount_point: str
    fstype: str
    device: str
    options: str

    @property
    def network(self) -> bool:
        t = self.fstype.lower()
        base = t.split(".", 1)[1] if t.startswith("fuse.") else t
        return t in NETWORK_FS or base in NETWORK_FS

    @property
    def read_only(self) -> bool:
        return "ro" in self.options.split(",")


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal.
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def find_mount(path: str, mounts_file: str = "/proc/mounts") -> MountInfo | None:
    """The mount that holds ``path`` (the longest mount point that prefixes its real path)."""
    real = os.path.realpath(path)
    best: MountInfo | None = None
    try:
        lines = Path(mounts_file).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mp = _unescape(parts[1])
        if real == mp or real.startswith(mp.rstrip("/") + "/") or mp == "/":
            # Later entries over the same mount point shadow earlier ones (>= keeps the last).
            if best is None or len(mp) >= len(best.mount_point):
                best = MountInfo(mp, parts[2], _unescape(parts[0]), parts[3])
    return best


def _existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return p


def check_exists(path: str, *, create: bool = True) -> CheckResult:
    # One stat, then makedirs(exist_ok): the probes of several nodes run this on the same new path at once,
    # and an isdir-then-exists pair saw another node's fresh directory as "not a directory".
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        is_dir = None
    except OSError as e:
        return CheckResult("exists", FAIL, f"cannot stat: {e.strerror}", "check the path's permissions",
                           path=path)
    if is_dir:
        return CheckResult("exists", PASS, "directory exists", path=path)
    not_dir = CheckResult("exists", FAIL, "exists but is not a directory", "choose a directory path",
                          path=path)
    if is_dir is False:
        return not_dir
    if not create:
        return CheckResult("exists", FAIL, "missing", f"create it (mkdir -p {path}), or pass --create",
                           path=path)
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:  # makedirs(exist_ok=True) raises it only for a path that is not a directory
        return not_dir
    except OSError as e:
        anc = _existing_ancestor(path)
        return CheckResult("exists", FAIL, f"cannot create: {e.strerror}",
                           f"create it as a user who can write {anc}, or mount the shared filesystem there",
                           path=path)
    return CheckResult("exists", PASS, "created", path=path)


def _errno_fix(e: OSError, path: str) -> str:
    if e.errno == errno.EROFS:
        return f"the filesystem holding {path} is mounted read-only; remount it rw or pick another path"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"chown/chmod {path} so user {os.getuid()} can write it, or pick another path"
    if e.errno == errno.ENOSPC:
        return "the filesystem is full; free space or pick another path"
    if e.errno == errno.EDQUOT:
        return "your quota is exhausted; free space or raise the quota"
    return "check the mount and permissions"


def probe_dir(path: str) -> Path:
    """This process's own directory under ``<path>/.areal_storage_probe/``, created on first use.

    Own, so that runs started at the same moment on one fileroot do not race: one run's cleanup removes the
    shared parent only when it is empty, and it is not while another run's directory is in it. Raises the
    OSError of a directory that cannot be made (read-only, no permission), for the check to report."""
    d = Path(path) / PROBE_DIR / f"local-{os.getpid()}-{_TOKEN}"
    for _ in range(4):  # another run may remove the empty parent between our mkdirs; create it again
        try:
            d.mkdir(parents=True, exist_ok=True)
            return d
        except FileNotFoundError:
            if not os.path.isdir(path):
                raise
    d.mkdir(parents=True, exist_ok=True)
    return d


_TOKEN = uuid.uuid4().hex[:8]


def check_writable(path: str) -> CheckResult:
    try:
        f = probe_dir(path) / f"w-{uuid.uuid4().hex}"
        fd = os.open(f, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.write(fd, b"areal")
        finally:
            os.close(fd)
        os.unlink(f)
    except OSError as e:
        return CheckResult("writable", FAIL, f"{e.strerror} (errno {e.errno})", _errno_fix(e, path), path=path)
    return CheckResult("writable", PASS, f"uid {os.getuid()} can create files", path=path)


def check_free_space(path: str, required_bytes: int) -> CheckResult:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return CheckResult("free space", FAIL, f"statvfs failed: {e.strerror}", _errno_fix(e, path), path=path)
    free = st.f_bavail * st.f_frsize
    fig = f"{human_bytes(free)} free, run needs {human_bytes(required_bytes)}"
    if free < required_bytes:
        return CheckResult("free space", FAIL, fig,
                           "free space, lower trainer.keep_checkpoints, or point cluster.fileroot at a larger "
                           "filesystem", path=path, value=float(free))
    if free < 1.25 * required_bytes:
        return CheckResult("free space", WARN, fig, "less than 25% headroom over the checkpoint estimate",
                           path=path, value=float(free))
    return CheckResult("free space", PASS, fig, path=path, value=float(free))


def check_fsync(path: str, n: int = 8) -> CheckResult:
    lat = []
    try:
        f = probe_dir(path) / f"fsync-{uuid.uuid4().hex}"
        fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            block = os.urandom(4096)
            for _ in range(n):
                os.write(fd, block)
                t = time.perf_counter()
                os.fsync(fd)
                lat.append(time.perf_counter() - t)
        finally:
            os.close(fd)
            _unlink(f)
    except OSError as e:
        return CheckResult("fsync latency", FAIL, f"{e.strerror}", _errno_fix(e, path), path=path)
    med = statistics.median(lat)
    fig = f"median {med * 1e3:.2f} ms, max {max(lat) * 1e3:.2f} ms over {n}"
    if med > FSYNC_WARN_S:
        return CheckResult("fsync latency", WARN, fig, "checkpoints and recover saves will be slow here",
                           path=path, value=med)
    return CheckResult("fsync latency", PASS, fig, path=path, value=med)


def check_throughput(path: str, size_bytes: int = 32 * 1024 * 1024) -> list[CheckResult]:
    """Sequential write (with a final fsync) and read of ``size_bytes``.

    The page cache is dropped for the file before reading, where the filesystem supports it, so
    the read figure is the device's rather than RAM's (tmpfs has no device and stays in RAM).
    """
    f = ""  # nothing to remove if the probe directory cannot be made
    chunk = os.urandom(1024 * 1024)
    try:
        f = probe_dir(path) / f"tp-{uuid.uuid4().hex}"
        st = os.statvfs(path)
        size_bytes = max(len(chunk), min(size_bytes, (st.f_bavail * st.f_frsize) // 4))
        n_chunks = max(1, size_bytes // len(chunk))
        fd = os.open(f, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            t = time.perf_counter()
            for _ in range(n_chunks):
                os.write(fd, chunk)
            os.fsync(fd)
            wt = time.perf_counter() - t
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(f, os.O_RDONLY)
        try:
            t = time.perf_counter()
            while os.read(fd, 4 * 1024 * 1024):
                pass
            rt = time.perf_counter() - t
        finally:
            os.close(fd)
    except OSError as e:
        _unlink(f)
        fix = _errno_fix(e, path)
        return [CheckResult("write throughput", FAIL, e.strerror or str(e), fix, path=path),
                CheckResult("read throughput", FAIL, "not measured (write failed)", fix, path=path)]
    _unlink(f)
    nbytes = n_chunks * len(chunk)
    wbps, rbps = nbytes / max(wt, 1e-9), nbytes / max(rt, 1e-9)
    w = CheckResult("write throughput", PASS, f"{human_bytes(wbps)}/s ({human_bytes(nbytes)} + fsync)",
                    path=path, value=wbps)
    if wbps < WRITE_WARN_BPS:
        w.status, w.fix = WARN, "slow sequential writes: checkpoints will take long"
    r = CheckResult("read throughput", PASS, f"{human_bytes(rbps)}/s", path=path, value=rbps)
    return [w, r]


def check_atomic_rename(path: str) -> CheckResult:
    target = tmp = ""  # nothing to remove if the probe directory cannot be made
    try:
        d = probe_dir(path)
        target, tmp = d / f"rn-{uuid.uuid4().hex}", d / f"rn-{uuid.uuid4().hex}.tmp"
        target.write_bytes(b"old")
        tmp.write_bytes(b"new")
        os.replace(tmp, target)
        ok = target.read_bytes() == b"new" and not tmp.exists()
    except OSError as e:
        _unlink(tmp)
        _unlink(target)
        return CheckResult("atomic rename", FAIL, e.strerror or str(e),
                           "this filesystem cannot replace files atomically; checkpoints and the name "
                           "registry need it — use a POSIX filesystem", path=path)
    _unlink(target)
    if not ok:
        return CheckResult("atomic rename", FAIL, "rename over an existing file did not take effect",
                           "use a POSIX filesystem (object-store FUSE mounts often lack rename)", path=path)
    return CheckResult("atomic rename", PASS, "os.replace over an existing file works", path=path)


def check_locking(path: str) -> CheckResult:
    """A POSIX lock held here must block another process (NFS needs lockd for that)."""
    try:
        f = probe_dir(path) / f"lock-{uuid.uuid4().hex}"
        fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        return CheckResult("file locking", FAIL, e.strerror or str(e), _errno_fix(e, path), path=path)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return CheckResult("file locking", FAIL, f"lockf failed: {e.strerror}",
                               "enable locking on the mount (NFS: run rpc.statd/lockd, do not mount with nolock)",
                               path=path)
        pid = os.fork()
        if pid == 0:  # child: the lock must be refused
            code = 3
            try:
                cfd = os.open(f, os.O_RDWR)
                try:
                    fcntl.lockf(cfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    code = 1  # acquired: locks are not enforced between processes
                except OSError as e:
                    code = 0 if e.errno in (errno.EAGAIN, errno.EACCES) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
        _unlink(f)
    if code == 0:
        return CheckResult("file locking", PASS, "fcntl locks exclude other processes", path=path)
    return CheckResult("file locking", FAIL,
                       "a second process acquired a held lock" if code == 1 else f"lock probe error ({code})",
                       "locks are not enforced on this mount (NFS with nolock / local_lock); remount with "
                       "locking enabled", path=path)


def check_filesystem(path: str, multi_node: bool) -> CheckResult:
    m = find_mount(_existing_ancestor(path))
    if m is None:
        return CheckResult("filesystem", WARN, "mount not found in /proc/mounts", path=path)
    kind = "network" if m.network else "local"
    fig = f"{m.fstype} ({kind}) on {m.mount_point}"
    if multi_node and not m.network:
        return CheckResult("filesystem", WARN, fig,
                           "a multi-node run needs a shared filesystem (nfs, lustre, gpfs, ceph, juicefs, ...) "
                           "at this path on every node", path=path)
    return CheckResult("filesystem", PASS, fig, path=path)


def run_local_checks(path: str, *, required_bytes: int = 0, multi_node: bool = False,
                     throughput_bytes: int = 32 * 1024 * 1024, create: bool = True) -> list[CheckResult]:
    """All single-node checks on ``path``; later checks are skipped when the path is unusable."""
    out = [check_filesystem(path, multi_node)]
    ex = check_exists(path, create=create)
    out.append(ex)
    if ex.failed:
        return out
    w = check_writable(path)
    out.append(w)
    out.append(check_free_space(path, required_bytes))
    if w.failed:
        return out
    out.append(check_fsync(path))
    if throughput_bytes > 0:
        out.extend(check_throughput(path, throughput_bytes))
    out.append(check_atomic_rename(path))
    out.append(check_locking(path))
    _cleanup(path)
    return out


def _unlink(p: os.PathLike | str) -> None:
    if not p:
        return
    try:
        os.unlink(p)
    except OSError:
        pass


def _cleanup(path: str) -> None:
    own = Path(path) / PROBE_DIR / f"local-{os.getpid()}-{_TOKEN}"
    for d in (own, own.parent):  # the parent only when empty: other runs' probes may still use it
        try:
            d.rmdir()
        except OSError:
            pass
