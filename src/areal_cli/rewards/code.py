"""Code-execution reward: run the completion's program in a sandboxed subprocess.

Sandbox: a fresh ``python -I`` in a temporary directory, its own session (killed as a group),
``setrlimit`` limits on CPU seconds, address space, file size, open files and core dumps, a wall
clock timeout, stdout/stderr written to size-limited files, and no network. Network isolation
uses a new network namespace (``unshare -n``; ``unshare -rn`` for non-root users with user
namespaces): the process sees only a downed loopback device. Where neither works, the audit hook
below also refuses socket creation; :attr:`SandboxResult.isolation` says which applied.

A Python audit hook, installed before the program runs (audit hooks cannot be removed from Python
code), always refuses ``ctypes``, process spawning and the ``gc`` object walkers, and confines
``open``: reads of Python source and extension files inside the interpreter's installation and
``sys.path``, anything inside the sandbox directory, and a few ``/dev`` files. A program therefore
cannot read a dataset's tests from disk, directly or through a child process.

Test formats (:func:`parse_tests`): ``{"inputs": [...], "outputs": [...]}``, a list of
``{"input": ..., "output": ...}`` pairs (stdin → expected stdout, compared outside the sandbox), or
Python test code with at least one ``assert``. Anything else is an error, never a pass.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from areal_cli.rewards.outcome import Reward
from areal_cli.utils.procs import die_with_parent

_FENCE_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Always installed (main.py, before the program): see the module docstring. ``_BLOCKED`` gains
# "socket." where no network namespace is available.
_GUARD = '''import os as _o, sys as _s
def _areal_install_guard(blocked):
    real, getcwd, isdir, fsdecode, sep = _o.path.realpath, _o.getcwd, _o.path.isdir, _o.fsdecode, _o.sep
    home = real(getcwd())
    roots = tuple(sorted({real(p) + sep for p in (_s.prefix, _s.base_prefix, _s.exec_prefix,
                                                        _s.base_exec_prefix, *_s.path) if p and isdir(p)}))
    code_ext = (".py", ".pyc", ".so", ".pyd", ".pth")
    devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/stdin", "/dev/stdout", "/dev/stderr")
    writes = _o.O_WRONLY | _o.O_RDWR | _o.O_CREAT | _o.O_TRUNC | _o.O_APPEND

    def allowed(path, mode, flags):
        if isinstance(path, int):
            return True  # an fd the process already holds (stdin, a pipe)
        path = fsdecode(path)
        if path in devices:
            return True
        full = real(path)
        if full == home or full.startswith(home + sep):
            return True
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & writes)
        return not writing and full.endswith(code_ext) and full.startswith(roots)

    def guard(event, args):
        # ctypes.dlopen(None) is the interpreter's own symbol table, which ``import ctypes`` (and so
        # numpy) opens; using anything from it needs ctypes.dlsym, which stays blocked.
        if event.startswith(blocked) and not (event == "ctypes.dlopen" and args == (None,)):
            raise PermissionError("blocked in the areal sandbox: " + event)
        if event == "open" and not allowed(*args):
            raise PermissionError("blocked in the areal sandbox: open " + repr(args[0]))
    _s.addaudithook(guard)
_areal_install_guard(%r)
del _areal_install_guard, _o, _s
import runpy as _r
_r.run_path("program.py", run_name="__main__")
'''
_BLOCKED = ("ctypes.", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.fork",
            "gc.get_objects", "gc.get_referrers", "gc.get_referents")

# The assert-test harness (the sandbox's program for Python test code). It reads the candidate
# program, the tests and a one-time token from stdin before the program runs, runs the program and
# then the tests in one namespace, and prints the token (with its own saved os.write) only when both
# finished without an exception. Exiting early (exit(0), os._exit(0), an excepthook or atexit hook
# that exits 0) or replacing print / sys.exit therefore never passes: no token, no pass.
_ASSERT_HARNESS = '''def _areal_tests():
    import builtins, json, os, sys
    write, exit_, compile_, exec_, base = os.write, os._exit, builtins.compile, builtins.exec, BaseException
    payload = json.loads(sys.stdin.buffer.read())
    sys.stdin = open(os.devnull)
    token = payload.pop("token").encode()
    out = sys.stdout
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec_(compile_(payload.pop("program"), "solution.py", "exec", dont_inherit=True, optimize=0), ns)
        exec_(compile_(payload.pop("tests"), "tests.py", "exec", dont_inherit=True, optimize=0), ns)
        out.flush()
    except base:  # a failed assert, any error, or SystemExit from the program: not a pass
        write(2, b"areal: the program or its tests raised\\n")
        exit_(1)
    write(1, b"\\n" + token + b"\\n")
    exit_(0)
_areal_tests()
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
    blocked = _BLOCKED + (("socket.",) if isolation == "audit-hook" else ())
    cpu = cpu_s if cpu_s is not None else max(1, int(timeout_s + 0.999))
    with tempfile.TemporaryDirectory(prefix="areal_sandbox_") as tmp:
        # main.py installs the guard and runs program.py as __main__ (so a program may start with
        # ``from __future__ import ...`` and its tracebacks keep their line numbers).
        with open(os.path.join(tmp, "main.py"), "w") as f:
            f.write(_GUARD % (blocked,))
        with open(os.path.join(tmp, "program.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
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


@dataclass
class CodeTests:
    """A parsed reference: stdin/stdout ``cases``, or Python test ``code`` (exactly one is set)."""

    cases: list[tuple[str, str]] | None = None
    code: str | None = None


def _io_text(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"code reference: {where} must be a string (stdin / expected stdout), got "
                     f"{type(value).__name__}")


def parse_tests(answer: object) -> CodeTests:
    """Recognise a code reference, or raise ValueError (the reward runner counts it as an error).

    - ``{"inputs": [stdin, ...], "outputs": [stdout, ...]}``: equal, non-zero lengths;
    - ``[{"input": stdin, "output": stdout}, ...]``: at least one pair;
    - anything that is not JSON: Python test code that compiles and has at least one ``assert``.
    """
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"code reference must be a non-empty string, got {answer!r:.80}")
    try:
        spec = json.loads(answer)
    except json.JSONDecodeError:
        try:
            tree = ast.parse(answer)
        except (SyntaxError, ValueError) as e:
            raise ValueError(f"code reference is neither JSON tests nor Python test code: {e}") from None
        if not any(isinstance(node, ast.Assert) for node in ast.walk(tree)):
            raise ValueError("code reference: Python test code without an assert tests nothing")
        return CodeTests(code=answer)
    if isinstance(spec, dict) and set(spec) >= {"inputs", "outputs"}:
        ins, outs = spec["inputs"], spec["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs) or not ins:
            raise ValueError("code reference: 'inputs' and 'outputs' must be non-empty lists of equal length")
        return CodeTests(cases=[(_io_text(i, f"inputs[{k}]"), _io_text(o, f"outputs[{k}]"))
                                for k, (i, o) in enumerate(zip(ins, outs))])
    if isinstance(spec, list) and spec and all(isinstance(c, dict) and {"input", "output"} <= set(c)
                                               for c in spec):
        return CodeTests(cases=[(_io_text(c["input"], f"[{k}].input"), _io_text(c["output"], f"[{k}].output"))
                                for k, c in enumerate(spec)])
    raise ValueError(f"code reference: unrecognised JSON tests {answer!r:.120}; use "
                     '{"inputs": [...], "outputs": [...]} or [{"input": ..., "output": ...}, ...]')


def _compiles(program: str) -> bool:
    try:
        ast.parse(program)
    except (SyntaxError, ValueError):
        return False
    return True


def code_reward(prompt: str, completion: str, answer: str, timeout_s: float = 5.0, memory_mb: int = 512,
                **_) -> Reward:
    """1.0 if the completion's program passes every test, else 0.0 (see :func:`parse_tests`).

    An unrecognised reference raises ValueError. An empty or unparseable program scores 0 without
    running. I/O tests run the program once per case and compare its stdout outside the sandbox;
    Python test code runs under :data:`_ASSERT_HARNESS`, which must print a one-time token.
    """
    tests = parse_tests(answer)
    program = extract_code(completion)
    if not program.strip() or not _compiles(program):
        return Reward.of(False)
    if tests.cases is not None:
        for stdin, want in tests.cases:
            res = run_sandboxed(program, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)
            if not res.ok or not _same_output(res.stdout, want):
                return Reward.of(False)
        return Reward.of(True)
    token = secrets.token_hex(16)
    payload = json.dumps({"program": program, "tests": tests.code, "token": token})
    res = run_sandboxed(_ASSERT_HARNESS, stdin=payload, timeout_s=timeout_s, memory_mb=memory_mb)
    return Reward.of(res.ok and res.stdout.rstrip().endswith(token))
