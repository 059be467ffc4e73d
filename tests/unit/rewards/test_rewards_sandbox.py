"""The code-execution sandbox: network, CPU, memory, wall-clock and output limits really hold."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from areal_cli.rewards import get_reward_fn
from areal_cli.rewards.code import extract_code, network_isolation_prefix, run_sandboxed

CONNECT = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", {port}))
        print("CONNECTED")
    except Exception as e:
        print("BLOCKED", type(e).__name__)
""")


@pytest.fixture()
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    yield srv.getsockname()[1]
    srv.close()


def test_network_is_blocked(listener):
    code = CONNECT.format(port=listener)
    # Control: the same program outside the sandbox reaches the listener, so the check can fail.
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "CONNECTED" in plain.stdout
    res = run_sandboxed(code, timeout_s=10)
    assert "CONNECTED" not in res.stdout
    # In the empty namespace the connect fails; under the audit hook socket creation raises.
    assert "BLOCKED" in res.stdout or "PermissionError" in res.stderr
    assert res.isolation == network_isolation_prefix()[1]


def test_audit_hook_fallback_blocks_network_and_spawning(listener):
    res = run_sandboxed(CONNECT.format(port=listener), timeout_s=10, isolation="audit-hook")
    assert res.isolation == "audit-hook"
    assert "CONNECTED" not in res.stdout and "PermissionError" in res.stderr
    res = run_sandboxed("import subprocess\nsubprocess.run(['true'])\n", isolation="audit-hook")
    assert res.returncode != 0 and "blocked in the areal sandbox" in res.stderr
    res = run_sandboxed("import sys\nsys.addaudithook(lambda *a: None)\nprint(1 + 1)\n", isolation="audit-hook")
    assert res.ok and res.stdout.strip() == "2"  # ordinary programs still run


def test_wall_clock_timeout_kills_the_program():
    t0 = time.monotonic()
    res = run_sandboxed("import time\ntime.sleep(60)\n", timeout_s=1.0)
    assert res.timed_out and not res.ok
    assert time.monotonic() - t0 < 15


def test_cpu_limit():
    res = run_sandboxed("while True:\n    pass\n", timeout_s=20, cpu_s=1)
    assert res.timed_out  # SIGXCPU after 1 CPU second, long before the 20 s wall clock


def test_memory_limit():
    res = run_sandboxed("x = bytearray(1024 * 1024 * 1024)\nprint('ALLOCATED')\n", timeout_s=10,
                        memory_mb=256)
    assert res.returncode != 0 and "ALLOCATED" not in res.stdout
    assert "MemoryError" in res.stderr


def test_output_is_bounded():
    res = run_sandboxed("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout_s=10,
                        fsize_mb=1, max_output=4096)
    assert not res.ok and len(res.stdout) <= 4096


def test_stdin_and_exit_code():
    res = run_sandboxed("print(sum(map(int, input().split())))\n", stdin="2 3\n")
    assert res.ok and res.stdout.strip() == "5"
    assert run_sandboxed("raise SystemExit(3)").returncode == 3


def test_code_reward_formats():
    fn = get_reward_fn("code")
    io_tests = json.dumps({"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]})
    good = "Here:\n```python\nn = int(input())\nprint(n * 2)\n```"
    bad = "```python\nprint(int(input()) + 2)\n```"
    assert fn("q", good, io_tests) == 1.0
    assert fn("q", bad, io_tests) == 0.0  # 2+2 passes, 5+2 fails → all-or-nothing
    assert fn("q", "def sq(x):\n    return x * x\n", "assert sq(3) == 9\nassert sq(-2) == 4") == 1.0
    assert fn("q", "def sq(x):\n    return x + x\n", "assert sq(3) == 9") == 0.0
    assert fn("q", "import time\ntime.sleep(30)", "assert True", timeout_s=1.0) == 0.0
    assert extract_code("a\n```py\nA\n```\nb\n```python\nB\n```") == "B\n"


def sandbox_sleeper(prompt, completion, answer, **kw):
    return float(run_sandboxed("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n",
                               timeout_s=100).ok)


def _sandbox_children(since: float):
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if (p.info["cmdline"] and p.info["cmdline"][-2:] == ["-I", "main.py"]
                    and p.info["create_time"] >= since and "areal_sandbox_" in p.cwd()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_sandbox_child_dies_with_a_killed_reward_worker():
    import asyncio

    from areal_cli.rewards import AsyncRewardRunner

    since = time.time() - 1
    with AsyncRewardRunner(sandbox_sleeper, max_workers=1, timeout_s=4.0) as runner:
        assert asyncio.run(runner("q", "c", "a")) == 0.0 and runner.stats.timeout == 1
    # The worker was SIGKILLed at the timeout; its sandboxed python must not linger for 120 s.
    deadline = time.monotonic() + 10
    while _sandbox_children(since) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _sandbox_children(since)
    for p in leftover:
        p.kill()
    assert not leftover
