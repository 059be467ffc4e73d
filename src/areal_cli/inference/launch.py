"""Starting, waiting for and stopping inference servers (any registered backend).

``build_server_cmd`` is pure (argv + environment: the backend spec's ``server_cmd`` plus what every server
gets), so it is contract-tested without the backends installed. ``launch_server`` runs the command in its own
process group with a log file; ``wait_until_ready`` polls ``/health`` and, when the server dies or times out, raises
:class:`LaunchError` with the log tail and the likely cause.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass

from areal_cli.errors import ConfigError, LaunchError
from areal_cli.inference.backends import backend_names, backend_spec
from areal_cli.inference.backends.base import ServerArgs
from areal_cli.inference.backends.vllm import vllm_python  # noqa: F401  (its old home; tests import it here)
from areal_cli.utils.network import find_free_port
from areal_cli.utils.procs import ManagedProcess, describe_exit, tail_file

_DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


# Workflows whose requests never continue an earlier sequence: the hf server already prefills a group's
# shared prompt once, and a prefix cache would only hold every finished row until the next weight update.
SINGLE_TURN_WORKFLOWS = frozenset({"rlvr"})


def prefix_cache_tokens(workflow: str) -> int:
    """The hf server's ``--prefix-cache-tokens`` for a run of ``workflow``: 0 (off) for single-turn
    workflows, -1 (auto: 512 MiB of KV, at most 65536 tokens) for multi-turn and agent ones. The launcher
    puts it before ``launcher.server_args``, so a flag of the user's wins."""
    return 0 if workflow in SINGLE_TURN_WORKFLOWS else -1


def build_server_cmd(backend: str, model_path: str, host: str, port: int, *, tp: int = 1,
                     tp_size: int | None = None, pp: int = 1, dtype: str = "auto", device: str = "cpu", seed: int = 0,
                     api_key: str | None = None, context_length: int | None = None,
                     extra: list[str] | tuple[str, ...] = (), python: str | None = None,
                     cache_root: str | None = None, lora_rank: int = 0,
                     lora_targets: tuple[str, ...] | list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` for one server. ``env`` holds only the variables to add to the parent's.
    ``extra`` (e.g. ``launcher.server_args``) comes last, so it can override any flag set here.
    ``lora_rank > 0``: the server loads LoRA adapters at run time (the hf server always can)."""
    try:
        spec = backend_spec(backend)
    except ConfigError:
        raise LaunchError(f"unknown inference backend {backend!r}; expected one of {backend_names()}") from None
    tp = tp_size if tp_size is not None else tp
    if dtype not in _DTYPES:
        raise LaunchError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    if pp < 1 or (pp > 1 and "p" not in spec.dims):
        with_p = ", ".join(n for n in backend_names() if "p" in backend_spec(n).dims)
        raise LaunchError(f"pp={pp}: the {backend} server runs one process per replica (pp 1); use {with_p} "
                          "for pipeline-parallel servers")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    argv, own_env = spec.server_cmd(ServerArgs(
        model_path, host, port, tp=tp, pp=pp, dtype=_DTYPES[dtype], device=device, seed=seed,
        context_length=context_length, python=python, cache_root=cache_root, lora_rank=lora_rank,
        lora_targets=tuple(lora_targets)))
    env.update(own_env)
    if api_key:
        argv += ["--api-key", api_key]
    argv += list(extra)
    return argv, env


@dataclass
class ServerHandle:
    backend: str
    address: str
    proc: ManagedProcess
    log_path: str

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after ``timeout``; no orphans remain."""
        return self.proc.stop(timeout=timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(backend: str, model_path: str, *, host: str = "127.0.0.1", port: int | None = None,
                  log_dir: str | None = None, timeout_s: float = 180.0, wait: bool = True,
                  env: dict[str, str] | None = None, api_key: str | None = None, script: str | None = None,
                  **cmd_kwargs) -> ServerHandle:
    """Start a server on a free port (unless given) and, by default, wait until it is ready. ``script`` runs
    that file in place of the backend's module, with the same arguments (a benchmark's variant server)."""
    port = port or find_free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
    argv, cmd_env = build_server_cmd(backend, model_path, host, port, api_key=api_key, **cmd_kwargs)
    if script is not None:
        i = argv.index("-m")
        argv[i:i + 2] = [script]
    cmd_env.update(env or {})
    log_dir = log_dir or tempfile.mkdtemp(prefix="areal_server_logs_")
    log_path = os.path.join(log_dir, f"{backend}_server_{port}.log")
    proc = ManagedProcess(name=f"{backend}-server-{port}", argv=argv, log_path=log_path, env=cmd_env).start()
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    handle = ServerHandle(backend, f"{probe_host}:{port}", proc, log_path)
    if wait:
        try:
            wait_until_ready(handle.address, timeout_s, proc, log_path)
        except BaseException:
            handle.stop()
            raise
    return handle


def wait_until_ready(address: str, timeout_s: float, proc: ManagedProcess | None = None,
                     log_path: str | None = None, *, health_path: str = "/health",
                     poll_s: float = 0.5) -> None:
    """Poll ``health_path`` until 200. Raises LaunchError with the log tail and the likely cause."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            tail = tail_file(log_path, 40) if log_path else ""
            raise LaunchError(_failure_message(address, f"exited ({describe_exit(proc.poll())}) before "
                                                        "becoming ready", tail, log_path))
        try:
            r = httpx.get(f"http://{address}{health_path}", timeout=5.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(poll_s)
    tail = tail_file(log_path, 40) if log_path else ""
    raise LaunchError(_failure_message(address, f"not ready after {timeout_s:.0f}s (last probe: {last})",
                                       tail, log_path, timed_out=True))


_CAUSES: list[tuple[str, str]] = [
    (r"Address already in use|Errno 98", "the port is already taken by another process; pick another port "
                                         "(launch_server allocates a free one when port=None)"),
    (r"No module named '?vllm", "vllm is not installed in this interpreter; run scripts/setup_vllm_env.sh "
                                "and set AREAL_VLLM_PYTHON=.venv-vllm/bin/python"),
    (r"No module named '?sglang", "sglang is not installed; `pip install sglang` (GPU hosts) or use the "
                                  "built-in hf backend"),
    (r"No module named '?([\w\.]+)", "a Python dependency is missing from the server's environment"),
    (r"CUDA out of memory|OutOfMemoryError|torch\.OutOfMemoryError",
     "the GPU ran out of memory; lower --mem-fraction-static / gpu-memory-utilization or use a smaller model"),
    (r"Found no NVIDIA driver|CUDA driver|no CUDA-capable device|Torch not compiled with CUDA",
     "the server was asked for CUDA on a machine without a usable GPU; use device=cpu"),
    (r"Unsupported CPU attention configuration: head_dim=(\d+)",
     "vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, ... only; this model's head_dim "
     "is not one of them (use the hf backend or another model)"),
    (r"not a loopback address", "binding a non-loopback host requires --api-key"),
    (r"is not a directory|does not appear to have a file named|Can't load|OSError: .*config\.json|"
     r"Repo id must be|not a valid model identifier|HFValidationError",
     "the model path is wrong or is not an HF model dir (config.json + weights) on this host"),
    (r"KV cache|VLLM_CPU_KVCACHE_SPACE|No available memory for the cache blocks",
     "not enough memory for the KV cache; lower VLLM_CPU_KVCACHE_SPACE / max-model-len"),
    (r"Killed|SIGKILL|MemoryError|Cannot allocate memory", "the process ran out of host memory (OOM killer)"),
    (r"Permission denied", "a file or port needed by the server is not accessible to this user"),
    (r"unrecognized arguments|error: argument", "the server rejected its command line; check `extra` args and "
                                                "the installed backend version"),
]


def likely_cause(log_text: str, *, timed_out: bool = False) -> str:
    for pattern, cause in _CAUSES:
        m = re.search(pattern, log_text)
        if m:
            if "dependency" in cause and m.groups():
                return f"{cause} (module {m.group(1)!r})"
            return cause
    if timed_out:
        return ("the server is still loading or is stuck; raise the startup timeout, or read the log — "
                "on a busy CPU host model loading and warm-up can take minutes")
    return "unknown; read the log tail above"


def _failure_message(address: str, what: str, tail: str, log_path: str | None, timed_out: bool = False) -> str:
    cause = likely_cause(tail, timed_out=timed_out)
    shown = "\n".join("    " + ln for ln in tail.splitlines()[-25:]) or "    (empty log)"
    return (f"inference server at {address} {what}.\n  likely cause: {cause}\n  log: {log_path}\n"
            f"  last log lines:\n{shown}")
