"""launchers/failures.py on real logs: a dying process's log becomes one error line plus its log path, never
a traceback; the rank-log watch sees only this launch's lines."""

from __future__ import annotations

import subprocess
import sys

from areal_cli.errors import RANK_CRASH_PREFIX, USER_ERROR_PREFIX
from areal_cli.launchers.failures import RankLogWatch, exception_line, process_failure

CRASH = """
def level(n, exc):  # 30 distinct frames, so the traceback is longer than the tail that is read
    src = "def f%d(exc):\\n    f%d(exc)\\n" % (n, n - 1) if n else "def f0(exc):\\n    raise exc\\n"
    exec(src, globals())
for i in range(30):
    level(i, None)
try:
    f3(RuntimeError("boom in the step\\nsecond line: of the message"))
except RuntimeError as e:
    f29(ValueError("wrapped: bad value"))
"""


def _real_traceback(tmp_path) -> str:
    log = tmp_path / "rank.log"
    with open(log, "w") as f:
        f.write("[areal] trainer rank 0/1 pid 1\n")
        f.flush()
        subprocess.run([sys.executable, "-c", CRASH], stderr=f, stdout=f, check=False)
    return log.read_text()


def test_an_untyped_crash_gives_its_last_line_the_rank_and_the_log(tmp_path):
    text = _real_traceback(tmp_path)
    assert exception_line(text) == "ValueError: wrapped: bad value"
    # A tail that cut the traceback's head off (a deep stack) still has its last line.
    cut = "\n".join(text.splitlines()[-12:])
    assert "Traceback" not in cut and exception_line(cut) == "ValueError: wrapped: bad value"
    err = process_failure("trainer rank 0", tmp_path / "rank.log", cut, "exit code 1")
    assert str(err) == "trainer rank 0 failed: ValueError: wrapped: bad value"
    assert list(err.details) == [f"exit code 1; log {tmp_path / 'rank.log'}; everything was stopped"]


def test_a_typed_error_is_its_own_line_and_a_signal_says_how(tmp_path):
    tail = f"Traceback (most recent call last):\n  File \"x\", line 1\nDataError: bad\n{USER_ERROR_PREFIX}" \
           "dataset.prompt_field: no row has 'question' — fix: set it\n"
    err = process_failure("trainer rank 1", "/r/logs/trainer_rank1.log", tail, "exit code 1")
    assert str(err) == "dataset.prompt_field: no row has 'question' — fix: set it"
    assert list(err.details) == ["raised in trainer rank 1; log /r/logs/trainer_rank1.log; everything was stopped"]
    killed = process_failure("trainer rank 0", "/r/l.log", "[areal] step 3/6\n", "killed by SIGKILL")
    assert str(killed) == "trainer rank 0 failed (killed by SIGKILL)"
    usage = process_failure("inference server server0", "/r/s.log", "usage: hf_server [-h]\nhf_server: error: "
                            "unrecognized arguments: --bogus\n", "exit code 2", hint="check launcher.server_args")
    assert str(usage) == "inference server server0 failed: hf_server: error: unrecognized arguments: --bogus"
    assert list(usage.details)[-1] == "hint: check launcher.server_args"


def test_the_rank_log_watch_reads_only_this_launch(tmp_path):
    log = tmp_path / "trainer_rank0.log"
    log.write_text(f"old launch\n{RANK_CRASH_PREFIX}RuntimeError: from the launch before\n")
    watch = RankLogWatch(tmp_path)
    assert watch.poll() is None
    with open(log, "a") as f:
        f.write("[areal] step 3/6\n")
    assert watch.poll() is None
    (tmp_path / "trainer_rank1.log").write_text(f"Traceback …\n{RANK_CRASH_PREFIX}RuntimeError: collective\n")
    with open(log, "a") as f:
        f.write(f"{USER_ERROR_PREFIX}dataset.train_path: no usable rows\n")
    who, path, tail = watch.poll()
    assert (who, path) == ("trainer rank 0", log)  # the user's error wins over a peer's crash
    assert "launch before" not in tail and str(process_failure(who, path, tail, "exit code 1")) == \
        "dataset.train_path: no usable rows"


def test_a_nodes_failure_reaches_the_slurm_submitter_as_the_same_lines(tmp_path):
    """The node runner keeps its failure in the run dir; the SLURM submitter rebuilds it from there."""
    from areal_cli.job.status import read_node_error, record_node_error

    err = process_failure("trainer rank 3", "/r/logs/trainer_rank3.log", f"{RANK_CRASH_PREFIX}RuntimeError: x\n",
                          "exit code 1")
    record_node_error(tmp_path, 1, err)
    back = read_node_error(tmp_path)
    assert type(back) is type(err) and str(back) == str(err) == "trainer rank 3 failed: RuntimeError: x"
    assert list(back.details) == list(err.details)
