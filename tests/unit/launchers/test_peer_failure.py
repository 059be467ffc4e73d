"""launchers/local.py (the node runner): when a peer's collective error is the first line a rank prints, the local runner waits
briefly for torchrun to name its first observed failure, so a rank killed by a signal (which prints nothing)
is named, not the peer that lost its connection (test_train_exact_resume's kill -9 under load)."""

from __future__ import annotations

import sys
import types

import pytest

from areal_cli.errors import RANK_CRASH_PREFIX, USER_ERROR_PREFIX, LaunchError
from areal_cli.launchers import local
from areal_cli.launchers.failures import RankLogWatch
from areal_cli.utils.procs import ManagedProcess

# torchrun's agent line for a rank it saw die by SIGKILL (torch/distributed/elastic/multiprocessing/api.py)
TORCHRUN = ("import sys, time; time.sleep(1.0); "
            "print('E1130 api.py:1002] failed (exitcode: {code}) local_rank: 0 (pid: 4242) of binary: python'); "
            "sys.exit(1)")
PEER_LINE = (f"{RANK_CRASH_PREFIX} RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: "
             "Connection reset by peer\n")


def _launcher(tmp_path, code: int = -9, rank1_line: str = PEER_LINE) -> local.NodeRunner:
    logs = local.logs_dir(tmp_path)
    logs.mkdir(parents=True)
    for r in (0, 1):
        (logs / f"trainer_rank{r}.log").write_text(f"[areal] trainer rank {r}/2 pid {4242 + r}\n")
    launcher = object.__new__(local.NodeRunner)
    launcher.run_dir, launcher.node_rank, launcher.status, launcher._status_ended = str(tmp_path), 0, None, False
    launcher.layout = types.SimpleNamespace(trainer=types.SimpleNamespace(nproc_per_node=2, first_node=0))
    launcher.rank_logs = RankLogWatch(logs)
    with open(logs / "trainer_rank1.log", "a") as f:  # by default the peer's echo of rank 0's death
        f.write(rank1_line)
    launcher.trainer = ManagedProcess(name="trainer", argv=[sys.executable, "-c", TORCHRUN.format(code=code)],
                                      log_path=str(logs / "trainer_node0.log")).start()
    return launcher


def test_the_rank_killed_by_a_signal_is_named_not_its_peer(tmp_path):
    with pytest.raises(LaunchError) as e:
        local.NodeRunner._check_trainer(_launcher(tmp_path))
    assert "trainer rank 0" in str(e.value) and "SIGKILL" in str(e.value), str(e.value)


def test_without_the_grace_the_peer_would_be_named(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "_PEER_GRACE_S", 0.0)
    launcher = _launcher(tmp_path)
    try:
        with pytest.raises(LaunchError) as e:
            local.NodeRunner._check_trainer(launcher)
        assert "trainer rank 1" in str(e.value) and "SIGKILL" not in str(e.value), str(e.value)
    finally:
        launcher.trainer.stop(timeout=5)


def test_a_user_error_stays_named_when_torchrun_saw_no_signal(tmp_path):
    line = f"{USER_ERROR_PREFIX}algo.batch_size: must divide the rows (fix: set algo.batch_size=8)\n"
    with pytest.raises(LaunchError) as e:
        local.NodeRunner._check_trainer(_launcher(tmp_path, code=1, rank1_line=line))
    # a user error is its own one line (launchers/failures.py), not the rank's exit
    assert str(e.value).startswith("algo.batch_size: must divide the rows"), str(e.value)
