"""The sweep manifest: one JSON file that says what each trial is and how it ended.

Written atomically after every state change, so a sweep killed at any moment can be resumed: trials
that were ``pending``, ``running`` or ``failed`` run again, ``done`` and ``invalid`` ones never do.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from areal_cli.errors import UsageError

MANIFEST = "manifest.json"
RERUN_STATES = ("pending", "running", "failed")


@dataclass
class Trial:
    id: str
    overrides: list[str]
    status: str = "pending"  # pending | invalid | running | done | failed
    reason: str = ""
    run_dir: str = ""
    metrics: dict = field(default_factory=dict)
    wall_time_s: float | None = None
    returncode: int | None = None
    attempts: int = 0

    def value_of(self, key: str) -> str:
        """The value this trial gives a swept key (as written in its override)."""
        for ov in self.overrides:
            k, _, v = ov.partition("=")
            if k.lstrip("+~") == key:
                return v.strip("'\"")
        return ""


@dataclass
class Manifest:
    sweep_dir: str
    name: str
    fixed: list[str]
    swept: list[str]
    swept_keys: list[str]
    metric: str
    mode: str = "max"  # max | min
    launcher: str = "local"
    search: bool = False
    n_trials: int = 0
    trials: list[Trial] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    @property
    def path(self) -> Path:
        return Path(self.sweep_dir) / MANIFEST

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, sweep_dir: str | os.PathLike) -> "Manifest":
        path = Path(sweep_dir) / MANIFEST
        if not path.is_file():
            raise UsageError(f"--resume {sweep_dir}: no {MANIFEST} there — fix: pass the sweep dir a sweep "
                             "printed (sweep dir: ...)")
        raw = json.loads(path.read_text())
        raw["trials"] = [Trial(**t) for t in raw.get("trials", [])]
        return cls(**raw)

    def find(self, trial_id: str) -> Trial | None:
        return next((t for t in self.trials if t.id == trial_id), None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.status] = out.get(t.status, 0) + 1
        return out
