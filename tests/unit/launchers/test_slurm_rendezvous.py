"""SLURM's torch rendezvous travels through the run dir like the server addresses: node 0 writes one file
per job attempt, the other nodes wait for it (launchers/slurm.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from areal_cli.errors import LaunchError
from areal_cli.job.layout import write_json_atomic
from areal_cli.launchers.slurm import rendezvous_path, wait_rendezvous


def test_each_attempt_of_a_job_has_its_own_record(tmp_path):
    first, requeued = rendezvous_path(str(tmp_path), "42", "0"), rendezvous_path(str(tmp_path), "42", "1")
    assert first != requeued and first.parent == tmp_path / "slurm" / "rendezvous"
    assert rendezvous_path(str(tmp_path), "43", "0") != first
    write_json_atomic(first, {"addr": "node-a", "port": 29500})
    assert wait_rendezvous(first, timeout_s=1) == {"addr": "node-a", "port": 29500}
    with pytest.raises(LaunchError, match="did not publish the torch rendezvous"):
        wait_rendezvous(requeued, timeout_s=0.3, poll_s=0.05)  # the old attempt's port is never read


def test_a_node_waits_for_node_0_in_another_process(tmp_path):
    path = rendezvous_path(str(tmp_path), "7", "0")
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from areal_cli.job.layout import write_json_atomic
        time.sleep(0.5)
        write_json_atomic({str(path)!r}, {{"addr": "127.0.0.1", "port": 12345}})
    """)])
    try:
        assert not path.exists()  # the writer is still starting (and then sleeps): the wait is real
        assert wait_rendezvous(path, timeout_s=60, poll_s=0.05)["port"] == 12345
    finally:
        assert writer.wait(timeout=60) == 0
