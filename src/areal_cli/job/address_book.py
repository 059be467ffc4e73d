"""The server address book: ``<run_dir>/servers/<index>.json``, one record per live server. It lives on the
shared fileroot, so multi-node jobs see one book, and the trainer re-reads it to learn of restarted servers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal_cli.job.layout import write_json_atomic


def servers_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "servers"


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
