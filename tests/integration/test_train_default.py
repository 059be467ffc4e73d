"""The embedded default, end to end: `areal train` with no arguments must learn.

Slow (several minutes on 2 cores): `pytest -m slow tests/integration/test_train_default.py`.
The wall time is printed, never asserted (house rule); docs/train.md records measured figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from test_train import _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_default_run_learns(tmp_path):
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={tmp_path}"],
                         capture_output=True, text=True, env=_env(), timeout=1700)
    wall = time.time() - t0
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    runs = list((tmp_path / "runs").glob("*/*/summary.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    print(f"\ndefault run: wall {wall:.0f}s, accuracy {summary['accuracy_before']:.1%} -> "
          f"{summary['accuracy_after']:.1%}")
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.40, summary
    assert (runs[0].parent / "learning_curve.png").exists()
    assert (runs[0].parent / "checkpoints" / "final" / "config.json").exists()
