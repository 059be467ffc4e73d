"""``utils.dist.exit_after``: the exit code, the traceback, and a normal exit's cleanup (non-daemon threads
joined, thread-pool jobs finished, atexit hooks run, buffered output flushed) before ``os._exit`` skips the
interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from areal_cli.utils.dist import exit_after

    atexit.register(lambda: print("atexit hook", flush=True))

    def main():
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: (time.sleep(0.2), print("pool job")))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread"))).start()
        sys.stdout.write("buffered, no newline")
        how = sys.argv[1]
        if how == "raise":
            raise ValueError("boom")
        if how == "message":
            sys.exit("a message")
        return int(how)

    exit_after(main)
""")
HEAD = "buffered, no newline"


@pytest.mark.parametrize("how, code", [("0", 0), ("3", 3), ("raise", 1), ("message", 1)])
def test_exit_after_keeps_a_normal_exit_but_the_teardown(how, code):
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == code, out.stderr
    first, *rest = out.stdout.split("\n")
    # the unflushed write, then what the pool and the thread print once their sleep ends, then the hook
    assert first.startswith(HEAD) and rest[-1] == "", out.stdout
    assert sorted([first[len(HEAD):]] + rest[:1]) == ["pool job", "thread"], out.stdout
    assert rest[1:-1] == ["atexit hook"], out.stdout
    if how == "raise":
        assert "Traceback" in out.stderr and "ValueError: boom" in out.stderr
    if how == "message":
        assert out.stderr.strip() == "a message"
