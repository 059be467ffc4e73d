"""`areal sweep launcher=slurm`: trials run as one SLURM job array (submitit) on the local SLURM.

Run with: python -m pytest -m slurm tests/integration/sweep/test_sweep_slurm.py   (root)
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweep import SHORT

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def test_sweep_as_a_slurm_job_array(slurm_cluster, tmp_path, tiny_model_dir):
    sweep_dir = tmp_path / "sw"
    args = [f"cluster.fileroot={tmp_path}", f"model.path={tiny_model_dir}", *SHORT,
            "launcher.slurm.cpus_per_task=2", "launcher.slurm.mem_gb=8", "launcher.slurm.time_min=20",
            "seed=1,2", "launcher=slurm", "--sweep-dir", str(sweep_dir), "--max-parallel", "1"]
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "sweep", *args], capture_output=True,
                         text=True, timeout=850, env={**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    m = json.loads((sweep_dir / "manifest.json").read_text())
    assert m["launcher"] == "slurm"
    assert [t["status"] for t in m["trials"]] == ["done", "done"]
    # Both trials ran inside one array job: "<jobid>_<index>" folders written by submitit.
    jobs = sorted(p.name for p in (sweep_dir / "slurm").iterdir() if p.is_dir() and "_" in p.name)
    assert len(jobs) == 2 and len({j.split("_")[0] for j in jobs}) == 1, jobs
    for t in m["trials"]:
        assert Path(t["run_dir"], "metrics.jsonl").is_file()
        assert 0.0 <= t["metrics"]["accuracy_after"] <= 1.0
    assert len(list(csv.DictReader(open(sweep_dir / "results.csv")))) == 2
