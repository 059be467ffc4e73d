"""Fixtures shared by integration suites."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("slurm/local-cluster.sh needs root")
    was_up = shutil.which("scontrol") is not None and "is UP" in subprocess.run(
        ["scontrol", "ping"], capture_output=True, text=True).stdout
    r = subprocess.run(["bash", str(REPO / "slurm" / "local-cluster.sh")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert shutil.which("sbatch") and shutil.which("squeue")
    part = subprocess.run(["sinfo", "-h", "-o", "%P %a %D %t"], capture_output=True, text=True).stdout
    assert "up" in part
    # Idempotent: a second run finds everything up.
    r2 = subprocess.run(["bash", str(REPO / "slurm" / "local-cluster.sh")], capture_output=True, text=True,
                        timeout=120)
    assert r2.returncode == 0 and "up: node" in r2.stderr
    yield part
    if not was_up:  # leave the machine as we found it
        subprocess.run(["bash", str(REPO / "slurm" / "stop-local-cluster.sh"), "--munge"], check=False)


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_model_dir_b):
    """The two tiny test models (same architecture and tokenizer, different weights), loaded in-process."""
    from hf_server_helpers import load_model

    return load_model(tiny_model_dir), load_model(tiny_model_dir_b)
