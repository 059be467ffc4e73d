"""The per-node storage probe: ``python -m areal_cli.storage.node_probe --path P --node-id N --expect K ...``.

Each node writes a random token file into ``<P>/.areal_storage_probe/xnode-<session>/`` and
records every other node's token it can read while waiting for ``K`` tokens to appear; then it
runs the single-node checks. It prints one line ``AREAL_PROBE_RESULT <json>`` that the
coordinator (:mod:`areal_cli.storage.crossnode`) compares across nodes. Stdlib only, so it starts
fast on every node.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

MARKER = "AREAL_PROBE_RESULT "


def default_node_id() -> str:
    return (os.environ.get("AREAL_PROBE_NODE_ID") or os.environ.get("SLURMD_NODENAME")
            or socket.gethostname())


def exchange_tokens(path: str, node_id: str, expect: int, session: str, timeout_s: float,
                    poll_s: float = 0.1) -> dict:
    """Write this node's token, collect the others'. Returns {token, seen, error}."""
    from areal_cli.storage.path_checks import PROBE_DIR

    d = Path(path) / PROBE_DIR / f"xnode-{session}"
    token = uuid.uuid4().hex
    mine = d / f"{node_id}.token"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{node_id}.{os.getpid()}.tmp"
        tmp.write_text(token)
        os.replace(tmp, mine)
    except OSError as e:
        return {"token": token, "seen": {}, "error": f"cannot write token: {e.strerror}"}
    seen: dict[str, str] = {}
    deadline = time.time() + timeout_s
    while True:
        # Read continuously: a peer that gives up early removes its token, and what was seen counts.
        for p in d.glob("*.token"):
            name = p.name[: -len(".token")]
            if name not in seen:
                try:
                    seen[name] = p.read_text()
                except OSError:
                    continue
        if len(seen) >= expect or time.time() > deadline:
            break
        time.sleep(poll_s)
    all_seen = len(seen) >= expect
    try:
        (d / f"{node_id}.done").write_text("1")
    except OSError:
        pass
    # Keep the token until every peer has read it (their .done files), or briefly when some are missing.
    # .done files stay: removing one could hide it from a peer still counting; the coordinator (or a
    # later probe, after an hour) removes the whole session directory.
    grace = time.time() + (timeout_s if all_seen else min(2.0, timeout_s))
    while len(list(d.glob("*.done"))) < expect and time.time() < grace:
        time.sleep(poll_s)
    try:
        mine.unlink()
    except OSError:
        pass
    return {"token": token, "seen": seen, "error": None}


def remove_session(path: str, session: str) -> None:
    """Remove one session's token directory (and stale ones older than an hour)."""
    import shutil

    from areal_cli.storage.path_checks import PROBE_DIR

    root = Path(path) / PROBE_DIR
    shutil.rmtree(root / f"xnode-{session}", ignore_errors=True)
    try:
        for old in root.glob("xnode-*"):
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        root.rmdir()
    except OSError:
        pass


def probe(paths: list[str], node_id: str, expect: int, session: str, timeout_s: float, *,
          required_bytes: int = 0, throughput_bytes: int = 0, multi_node: bool = True,
          local_checks: bool = True, create: bool = True) -> dict:
    from areal_cli.storage.path_checks import check_exists, run_local_checks

    out: dict = {"node": node_id, "hostname": socket.gethostname(), "pid": os.getpid(), "paths": {}}
    for p in paths:
        ex = check_exists(p, create=create)
        if ex.failed:
            rec = {"token": None, "seen": {}, "error": f"path unusable: {ex.figure}"}
        else:
            rec = exchange_tokens(p, node_id, expect, session, timeout_s)
        rec["local"] = ([asdict(r) for r in run_local_checks(p, required_bytes=required_bytes,
                                                             multi_node=multi_node,
                                                             throughput_bytes=throughput_bytes,
                                                             create=create)]
                        if local_checks else [])
        out["paths"][p] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_cli.storage.node_probe")
    ap.add_argument("--path", action="append", required=True)
    ap.add_argument("--node-id", default=None)
    ap.add_argument("--expect", type=int, default=1)
    ap.add_argument("--session", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--required-bytes", type=int, default=0)
    ap.add_argument("--throughput-bytes", type=int, default=0)
    ap.add_argument("--single-node", action="store_true")
    ap.add_argument("--no-local-checks", action="store_true")
    ap.add_argument("--no-create", action="store_true", help="report a missing path instead of creating it")
    a = ap.parse_args(argv)
    res = probe(a.path, a.node_id or default_node_id(), a.expect, a.session, a.timeout,
                required_bytes=a.required_bytes, throughput_bytes=a.throughput_bytes,
                multi_node=not a.single_node, local_checks=not a.no_local_checks, create=not a.no_create)
    sys.stdout.write(MARKER + json.dumps(res) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
