"""Code-execution reward: run the completion's program in a sandboxed subprocess.

Sandbox: a fresh ``python -I`` in a temporary directory, its own session (killed as a group),
``setrlimit`` limits on CPU seconds, address space, file size, open files and core dumps, a wall
clock timeout, stdout/stderr written to size-limited files, and no network. Network isolation
uses a new network namespace (``unshare -n``; ``unshare -rn`` for non-root users with user
namespaces): the process sees only a downed loopback device. Where neither works, a Python audit
hook installed before the program runs refuses socket creation, ``ctypes`` and process spawning
(audit hooks cannot be removed from Python code); :attr:`SandboxResult.isolation` says which
applied.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from areal_cli.utils.procs import die_with_parent

_FENCE_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

_AUDIT_GUARD = '''import sys as _s
def _areal_guard(event, args, _blocked=("socket.", "ctypes.", "subprocess.Popen", "os.exec", "os.posix_spawn",
                 "os.spawn", "os.system", "os.fork")):
    if event.startswith(_blocked):
        raise PermissionError("blocked in the areal sandbox: " + event)
_s.addaudithook(_areal_guard)
del _s
'''


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str  # "netns" | "userns+netns" | "audit-hook"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.lru_cache(maxsize=1)
def network_isolation_prefix() -> tuple[tuple[str, ...], str]:
    """The argv prefix that puts a child into an empty network namespace, and its name."""
    exe = shutil.which("unshare")
    if exe:
        for args, name in (((exe, "-n", "--"), "netns"), ((exe, "-rn", "--"), "userns+netns")):
            try:
                r = subprocess.run([*args, "true"], capture_output=True, timeout=10)
            except (OSError, subprocess.SubprocessError):
                continue
            if r.returncode == 0:
                return args, name
    return (), "audit-hook"


def _limits(cpu_s: int, memory_mb: int, fsize_mb: int):
    # SIGKILL this child if the process that started it dies (e.g. a killed reward worker).
    die = die_with_parent(signal.SIGKILL)

    def apply() -> None:
        if die is not None:
            die()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fs = fsize_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    return apply


def run_sandboxed(code: str, stdin: str = "", timeout_s: float = 5.0, cpu_s: int | None = None,
                  memory_mb: int = 512, fsize_mb: int = 8, max_output: int = 1 << 20,
                  isolation: str = "auto") -> SandboxResult:
    """Run ``code`` as a Python program under the limits above and return what it did.

    ``isolation="audit-hook"`` forces the fallback network guard (used where namespaces are missing).
    """
    prefix, iso = network_isolation_prefix()
    if isolation == "audit-hook":
        prefix, iso = (), "audit-hook"
    elif isolation != "auto":
        raise ValueError(f"isolation must be 'auto' or 'audit-hook', got {isolation!r}")
    isolation = iso
    if isolation == "audit-hook":
        code = _AUDIT_GUARD + code
    cpu = cpu_s if cpu_s is not None else max(1, int(timeout_s + 0.999))
    with tempfile.TemporaryDirectory(prefix="areal_sandbox_") as tmp:
        with open(os.path.join(tmp, "main.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([*prefix, sys.executable, "-I", "main.py"], cwd=tmp, env=env,
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True,
                                    preexec_fn=_limits(cpu, memory_mb, fsize_mb))
            timed_out = False
            try:
                proc.communicate(input=stdin.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        rc = proc.returncode
        # RLIMIT_CPU delivers SIGXCPU: count it as a timeout, like the wall clock.
        timed_out = timed_out or rc == -signal.SIGXCPU
        with open(out_path, "rb") as f:
            stdout = f.read(max_output).decode("utf-8", "replace")
        with open(err_path, "rb") as f:
            stderr = f.read(max_output).decode("utf-8", "replace")
    return SandboxResult(rc, stdout, stderr, timed_out, isolation)


def extract_code(completion: str) -> str:
    """The last fenced code block, or the whole completion when there is none."""
    blocks = _FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


def _same_output(got: str, want: str) -> bool:
    g = [ln.rstrip() for ln in got.strip().splitlines()]
    w = [ln.rstrip() for ln in want.strip().splitlines()]
    return g == w


def code_reward(prompt: str, completion: str, answer: str, timeout_s: float = 5.0, memory_mb: int = 512,
                **_) -> float:
    """1.0 if the completion's program passes every test, else 0.0.

    ``answer`` is either JSON ``{"inputs": [stdin, ...], "outputs": [stdout, ...]}`` (each pair is
    one run) or Python test code (e.g. ``assert f(2) == 4``) appended to the program.
    """
    program = extract_code(completion)
    try:
        spec = json.loads(answer)
    except (json.JSONDecodeError, TypeError):
        spec = None
    if isinstance(spec, dict) and "inputs" in spec and "outputs" in spec:
        if len(spec["inputs"]) != len(spec["outputs"]):
            raise ValueError("code reference: 'inputs' and 'outputs' differ in length")
        for stdin, want in zip(spec["inputs"], spec["outputs"]):
            res = run_sandboxed(program, stdin=str(stdin), timeout_s=timeout_s, memory_mb=memory_mb)
            if not res.ok or not _same_output(res.stdout, str(want)):
                return 0.0
        return 1.0
    res = run_sandboxed(program + "\n\n" + answer + "\n", timeout_s=timeout_s, memory_mb=memory_mb)
    return float(res.ok)
