"""Config group names and their options, from a scan of the packaged conf dir (no imports)."""

from __future__ import annotations

import os
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algo", "engine", "allocation_mode", "workflow", "launcher", "model", "dataset", "cluster",
          "rollout", "experiment")


def group_options(conf_dir: Path = CONF_DIR) -> dict[str, list[str]]:
    """``{group: [option, ...]}`` from the packaged conf dir (a directory scan, no Hydra)."""
    out: dict[str, list[str]] = {}
    for g in GROUPS:
        d = conf_dir / g
        out[g] = sorted(p[:-5] for p in os.listdir(d) if p.endswith(".yaml")) if d.is_dir() else []
    return out
