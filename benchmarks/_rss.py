"""Resident-memory helpers for ``engine_memory.py --peak``: a per-phase peak meter for the worker ranks,
and a watchdog that the parent runs over a layout's process tree.

Peak per phase: Linux keeps a high-water mark of the resident set (``VmHWM``); writing ``5`` to
``/proc/self/clear_refs`` resets it to the current RSS, so "reset, run the phase, read VmHWM" is the
exact peak of that phase, however short the spike. Some kernels/containers refuse the write or ignore it,
so the meter checks that the reset took (HWM fell to RSS) and always runs a sampling thread beside it
(VmRSS every ``interval`` s): the fallback when the reset does not work, and a cross-check when it does.
"""

from __future__ import annotations

import os
import re
import threading
import time

GIB = 1024 ** 3
_FIELD = {name: re.compile(rf"^{name}:\s+(\d+) kB", re.M)
          for name in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")}


def _status(pid: int | str = "self") -> str:
    with open(f"/proc/{pid}/status") as f:
        return f.read()


def _kb(text: str, name: str) -> int:
    m = _FIELD[name].search(text)
    return int(m.group(1)) * 1024 if m else 0


def rss_bytes() -> int:
    return _kb(_status(), "VmRSS")


def hwm_bytes() -> int:
    return _kb(_status(), "VmHWM")


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; True when the kernel accepted the write and the mark actually fell
    to (about) the current RSS (within 64 MiB: pages touched between the two reads)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    text = _status()
    return _kb(text, "VmHWM") - _kb(text, "VmRSS") < 64 * 1024 ** 2


class PeakMeter:
    """Peak RSS of successive phases of one process, by HWM reset when that works, sampled always."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self._peak = self._anon = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # probe: touching 256 MiB and freeing it must raise the mark and a reset must bring it back
        # down, otherwise VmHWM is not trustworthy here
        self.hwm_works = self._probe()
        self.method = "hwm" if self.hwm_works else "sampled"
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _probe() -> bool:
        if not reset_hwm():
            return False
        before = hwm_bytes()
        buf = bytearray(256 * 1024 ** 2)  # zero-filled by the kernel on touch: write one byte per page
        for i in range(0, len(buf), 4096):
            buf[i] = 1
        raised = hwm_bytes() - before > 200 * 1024 ** 2
        del buf
        return raised and reset_hwm()

    def _sample(self) -> None:
        while not self._stop.is_set():
            text = _status()
            r, a = _kb(text, "VmRSS"), _kb(text, "RssAnon")
            with self._lock:
                self._peak, self._anon = max(self._peak, r), max(self._anon, a)
            time.sleep(self.interval)

    def start(self) -> None:
        if self.hwm_works:
            reset_hwm()
        text = _status()
        with self._lock:
            self._peak, self._anon = _kb(text, "VmRSS"), _kb(text, "RssAnon")
        self._t0 = time.perf_counter()

    def stop(self) -> dict:
        """The phase's figures in GiB: ``peak`` (the method's), ``hwm`` and ``sampled`` (both kept so the
        two methods can be compared), ``anon_sampled`` (sampled peak of anonymous memory alone: weights
        read through safetensors' mmap are file-backed RSS, reclaimable, until something copies them),
        ``end`` and ``end_file`` (RSS and its file-backed part when the phase returned), and its wall time."""
        text = _status()
        end, end_file = _kb(text, "VmRSS"), _kb(text, "RssFile")
        with self._lock:
            sampled, anon = max(self._peak, end), max(self._anon, _kb(text, "RssAnon"))
        hwm = hwm_bytes() if self.hwm_works else None
        peak = hwm if hwm is not None else sampled
        return {"peak": peak / GIB, "hwm": hwm / GIB if hwm is not None else None, "sampled": sampled / GIB,
                "anon_sampled": anon / GIB, "end": end / GIB, "end_file": end_file / GIB,
                "wall_s": time.perf_counter() - self._t0}

    def close(self) -> None:
        self._stop.set()


def tree_pids(pids: list[int]) -> list[int]:
    """The given processes and all their live descendants (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_private_bytes(pids: list[int]) -> int:
    """Anonymous + shmem resident bytes of the process trees: what cannot be reclaimed under pressure.
    Plain RSS summed over ranks would count the shared torch libraries once per rank."""
    total = 0
    for p in tree_pids(pids):
        try:
            text = _status(p)
        except OSError:
            continue
        total += _kb(text, "RssAnon") + _kb(text, "RssShmem")
    return total


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0
