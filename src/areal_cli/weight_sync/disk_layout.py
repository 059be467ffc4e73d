"""Where disk weight pushes live: one scheme for every push of a run.

The trainer's disk pushes (the regular push in ``rollout.weight_update=disk``, the initial push after
an SFT warm start or a resume, bringing a restarted server back, ``algo=sft``'s evaluation pushes)
all write ``<run_dir>/weight_sync/v<version>/`` and point the servers at it. A sender writes there
itself (``WeightUpdateMeta.path`` is the root, the sender adds ``v<version>``); a trainer path that
saves with ``engine.save`` writes the same dir and loads it with :func:`load_meta`.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

WEIGHT_SYNC_DIR = "weight_sync"


def versioned_dir(root: str, version: int) -> str:
    return str(Path(root) / f"v{version}")


def disk_update_meta(run_dir: str, version: int) -> Any:
    """The :class:`WeightUpdateMeta` of a disk push of ``version``: path = the run's push root."""
    from areal_cli.api.io_struct import WeightUpdateMeta

    return WeightUpdateMeta(type="disk", version=version, path=str(Path(run_dir) / WEIGHT_SYNC_DIR))


def load_meta(meta: Any) -> Any:
    """``meta`` pointing the servers at the dir of its version (what a sender sends after writing it)."""
    return dataclasses.replace(meta, path=versioned_dir(meta.path, meta.version))


def pushed_dirs(root: str) -> list[Path]:
    """The version dirs under ``root``, oldest first (by version number, not by name: v10 > v9)."""
    base = Path(root)
    if not base.is_dir():
        return []
    dirs = [p for p in base.iterdir() if p.is_dir() and p.name[1:].isdigit() and p.name[0] == "v"]
    return sorted(dirs, key=lambda p: int(p.name[1:]))


def prune_pushed(root: str, keep: int) -> None:
    """Remove all but the newest ``keep`` version dirs (a server has loaded them)."""
    for p in pushed_dirs(root)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
