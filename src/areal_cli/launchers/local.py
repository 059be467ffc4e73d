"""The local launcher and the per-node runner every launcher uses.

:func:`run_node` runs one node's share of a :class:`JobLayout`: it starts the inference servers
placed on that node, waits until every server of the job is published, starts this node's trainer
ranks through torchrun, and supervises:

- a dead inference server is restarted on a fresh port and re-published (its in-flight requests
  fail over inside the client, which re-reads the address book);
- a dead trainer stops everything and the :class:`LaunchError` names the rank and its log tail;
- SIGINT/SIGTERM stop every child process group (trainer first, then servers), so no orphan
  keeps a port.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ArealError, LaunchError
from areal_cli.job.address_book import read_servers, retract_server
from areal_cli.job.status import STATUS_FILE, RunStatusWriter, record_node_error
from areal_cli.job.layout import MODEL_PATH_ENV, JobLayout, ServerSpec
from areal_cli.launchers.failures import RankLogWatch, process_failure
from areal_cli.launchers.supervisor import ServerSupervisor
from areal_cli.utils.procs import ManagedProcess, describe_exit, handling_stop_signals, tail_file

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

# how long a failing rank's peers get for torchrun to exit and name its first observed failure (a rank killed
# by a signal leaves no line of its own; its peers' collective errors come first in their logs)
_PEER_GRACE_S = 10.0


def logs_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "logs"


def base_env(device: str) -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        # Two cores are shared by a server and a trainer: one intra-op thread each avoids
        # oversubscription, which costs far more than it gains on tiny models.
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    return env


def train_thread_env(device: str, nproc_per_node: int) -> dict[str, str]:
    """On CPU, when each trainer rank's share of the node's cores is more than one thread (the trainer
    derives that share itself, trainer/rl.py:step_threads): how long an idle OpenMP worker spins before it
    sleeps, which libgomp reads once at start-up.

    libgomp's default (300k spins) has a worker whose peer lost its core to a busy server burn that
    core: an async step took 12 s instead of 1.2. Sleeping at once (0 spins) wakes the workers through
    the kernel at every parallel op: the embedded default's 0.5M-parameter train step took 0.064 s on two
    threads against 0.036 s with 20k spins, and the SFT warm start's steps lost 30%. 20k spins (tens of
    microseconds) are at least as fast as 0 in every RL row measured, sync and async, on both benchmark
    models. Measured in benchmarks/results/train_threads.md."""
    from areal_cli.utils.concurrency import cores_per_rank

    n = cores_per_rank(nproc_per_node) if device == "cpu" else 1
    return {"GOMP_SPINCOUNT": "20000"} if n > 1 else {}


def server_argv(cfg: ExperimentConfig, spec: ServerSpec, port: int, model_path: str, host: str,
                run_dir: str) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of one inference server (hf / vllm / sglang)."""
    from areal_cli.inference import launch as inf_launch

    extra: list[str] = []
    if spec.backend == "hf":
        # Weight updates from disk are read from the run dir; one thread leaves the other core to
        # the trainer on small CPU machines.
        roots = sorted({os.path.abspath(run_dir), os.path.dirname(os.path.abspath(model_path))})
        extra = ["--allowed-weight-roots", *roots]
        if cfg.cluster.device == "cpu":
            extra += ["--num-threads", os.environ.get("AREAL_SERVER_THREADS", "1")]
        extra += ["--prefix-cache-tokens", str(inf_launch.prefix_cache_tokens(cfg.workflow.name))]
        # the dataset's image budgets (docs/vision.md); launcher.server_args still win
        for flag, v in (("--max-image-pixels", cfg.dataset.max_image_pixels),
                        ("--max-image-tokens", cfg.dataset.max_image_tokens)):
            if v is not None:
                extra += [flag, str(int(v))]
    extra += [str(a) for a in cfg.launcher.server_args]  # last: the user's flags win
    from areal_cli.config.model import lora_target_modules

    lora = cfg.model.lora
    targets = lora_target_modules(lora.target_modules, moe=cfg.model.num_experts > 0) if lora.rank > 0 else ()
    return inf_launch.build_server_cmd(
        spec.backend, model_path, host, port, tp=spec.tp, pp=spec.pp, dtype=cfg.engine.dtype,
        device=cfg.cluster.device, seed=cfg.seed + spec.index, extra=extra, lora_rank=int(lora.rank),
        lora_targets=targets)


def trainer_argv(layout: JobLayout, config_path: str, node_rank: int, master_addr: str,
                 master_port: int) -> list[str]:
    t = layout.trainer
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(t.nnodes), "--nproc-per-node", str(t.nproc_per_node),
            "--node-rank", str(node_rank - t.first_node), "--master-addr", master_addr,
            "--master-port", str(master_port), "--max-restarts", "0",
            "--module", "areal_cli.trainer.entry", "--config", config_path]


@dataclasses.dataclass
class LocalServer:
    """One inference server this node runs: its child process group and where it listens."""

    spec: ServerSpec
    proc: ManagedProcess
    address: str
    epoch: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid


class NodeRunner(ServerSupervisor):
    """Runs and supervises one node's processes. See the module docstring; server supervision is
    :class:`~areal_cli.launchers.supervisor.ServerSupervisor`'s, shared with the Ray launcher."""

    def __init__(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str, *, node_rank: int = 0,
                 model_path: str | None = None, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, server_host: str = "127.0.0.1",
                 config_path: str | None = None, on_tick: Callable[[], None] | None = None,
                 poll_s: float = 0.5, model_revision: str | None = None):
        self.cfg, self.layout, self.run_dir = cfg, layout, str(run_dir)
        self.node_rank = node_rank
        self.model_path = model_path or cfg.model.path
        self.model_revision = model_revision if model_revision is not None else cfg.model.revision
        self.master_addr, self.master_port = master_addr, master_port
        self.server_host = server_host
        self.config_path = config_path or os.path.join(self.run_dir, "config.yaml")
        self.on_tick, self.poll_s = on_tick, poll_s
        self.servers: dict[int, LocalServer] = {}
        self.restarts = 0
        self.trainer: ManagedProcess | None = None
        self.rank_logs: RankLogWatch | None = None
        self._signal: int | None = None
        self.lock = threading.Lock()
        # status.json: the first trainer node keeps its heartbeat, every trainer node may record the end.
        self.status = None
        if node_rank in layout.trainer.node_ranks():
            job = {"slurm_job": os.environ["SLURM_JOB_ID"]} if os.environ.get("SLURM_JOB_ID") else {}
            self.status = RunStatusWriter(self.run_dir, str(cfg.launcher.name), node=node_rank, **job)
        self._status_ended = False

    # ------------------------------------------------------------------ servers
    def _spawn_server(self, spec: ServerSpec, epoch: int) -> LocalServer:
        from areal_cli.utils.network import find_free_port

        port = find_free_port(self.server_host)
        env = base_env(self.layout.device)
        if self.layout.device == "cuda" and spec.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.devices)
        argv, cmd_env = server_argv(self.cfg, spec, port, self.model_path, self.server_host, self.run_dir)
        env.update(cmd_env)
        env.update({k: str(v) for k, v in self.cfg.launcher.server_env.items()})
        proc = ManagedProcess(name=spec.name, log_path=str(logs_dir(self.run_dir) / f"{spec.name}.log"),
                              argv=argv, env=env).start()
        server = LocalServer(spec, proc, f"{self.server_host}:{port}", epoch)
        self.servers[spec.index] = server
        return server

    def _server_exit(self, p: LocalServer) -> str | None:
        return None if p.proc.alive() else describe_exit(p.proc.poll())

    def _server_healthy(self, p: LocalServer) -> bool:
        import httpx

        try:
            return httpx.get(f"http://{p.address}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _stop_server(self, p: LocalServer) -> None:
        p.proc.stop(timeout=5)

    def _check_workers(self) -> bool:
        return self._check_trainer()

    def _server_failed(self, p: LocalServer, why: str) -> LaunchError:
        return self._died(p.proc, hint=_server_hint(p.proc.tail(60)))

    def _server_not_ready(self, p: LocalServer) -> LaunchError:
        return LaunchError(f"{p.name} did not become ready within "
                           f"{self.cfg.launcher.server_startup_timeout_s:.0f}s "
                           f"(launcher.server_startup_timeout_s). Last log lines of {p.proc.log_path}:\n"
                           f"{p.proc.tail(30)}")

    def _out_of_restarts(self, p: LocalServer, why: str, limit: int) -> LaunchError:
        return self._died(p.proc, hint=f"restarts used: {self.restarts}/{limit} "
                                       "(launcher.max_server_restarts)")

    def _restart_line(self, p: LocalServer, why: str, limit: int) -> str:
        return f"[areal] {p.name} died ({why}); restarting ({self.restarts}/{limit}). Log: {p.proc.log_path}"

    def start_servers(self) -> list[LocalServer]:
        """Start this node's servers without waiting (the trainer boots meanwhile)."""
        return [self._spawn_server(s, 0) for s in self.layout.servers_on(self.node_rank)]

    def wait_servers(self, started: list[LocalServer]) -> None:
        for server in started:
            self._wait_ready(server)

    def _wait_all_published(self) -> None:
        want = len(self.layout.servers)
        deadline = time.time() + float(self.cfg.launcher.server_startup_timeout_s)
        while len(read_servers(self.run_dir)) < want:
            self._check_signal()
            if self._check_trainer():
                return
            self._supervise_servers()
            if time.time() > deadline:
                have = sorted(r["index"] for r in read_servers(self.run_dir))
                raise LaunchError(f"only servers {have} of {want} published their address in "
                                  f"{self.run_dir}/servers; check the other nodes' logs")
            time.sleep(0.25)

    # ------------------------------------------------------------------ trainer
    def start_trainer(self) -> None:
        from areal_cli.utils.network import find_free_port

        t = self.layout.trainer
        if self.master_port is None:
            self.master_port = find_free_port()
        env = base_env(self.layout.device)
        env[MODEL_PATH_ENV] = self.model_path
        env.update(train_thread_env(self.layout.device, t.nproc_per_node))
        env.update({k: str(v) for k, v in self.cfg.launcher.trainer_env.items()})
        self.rank_logs = RankLogWatch(logs_dir(self.run_dir))
        self.trainer = ManagedProcess(
            name="trainer", log_path=str(logs_dir(self.run_dir) / f"trainer_node{self.node_rank}.log"),
            argv=trainer_argv(self.layout, self.config_path, self.node_rank, self.master_addr,
                              self.master_port), env=env).start()
        del t

    def _trainer_exit_within(self, seconds: float) -> int | None:
        assert self.trainer is not None
        deadline = time.monotonic() + seconds
        while (code := self.trainer.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return code

    def _torchrun_culprit(self) -> tuple[str, Path, str, int] | None:
        assert self.trainer is not None
        return _torchrun_culprit(self.trainer.tail(200), self.run_dir, self.layout.trainer.nproc_per_node,
                                 self.node_rank - self.layout.trainer.first_node)

    def _trainer_failure(self, code: int | None) -> LaunchError:
        """Name the rank that failed first, with its error's one line (launchers/failures.py).

        A rank killed by a signal (SIGKILL, the OOM killer) leaves no traceback, while its peers then
        fail with collective errors that do: torchrun's first observed failure names the real cause.
        """
        killed = self._torchrun_culprit()
        if killed is not None and killed[3] < 0:
            return process_failure(*killed[:3], signal_how(killed[3]))
        found = _find_failed_rank(self.run_dir)
        if found is not None:
            rank_code = killed[3] if killed is not None and killed[1] == found[1] else 1
            return process_failure(*found, describe_exit(rank_code))
        if killed is not None:
            return process_failure(*killed[:3], describe_exit(killed[3]))
        node_log = logs_dir(self.run_dir) / f"trainer_node{self.node_rank}.log"
        return process_failure("trainer (torchrun)", node_log, self.trainer.tail(80), describe_exit(code))

    # ------------------------------------------------------------------ main loop
    def _handle(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    def fetch_model(self) -> None:
        """A hub id (launchers whose nodes fetch it) → this node's snapshot, downloaded once per node: other
        processes of the node sharing its HF cache (a second job's runner) wait on the cache's lock. Before
        the stop handlers are installed, so Ctrl-C or SIGTERM abort a long download at once."""
        from areal_cli.models.hub import ensure_local_model

        try:
            self.model_path = ensure_local_model(self.model_path, self.model_revision or None)
        except ArealError as e:
            record_node_error(self.run_dir, self.node_rank, e)
            raise

    def run(self) -> int:
        """Start, supervise, stop. Returns 0 on success, 128+signal after Ctrl-C/SIGTERM."""
        if self.status is not None and self.node_rank == self.layout.trainer.first_node:
            self.status.start()
        try:
            self.fetch_model()
        except BaseException as e:
            self._write_status("interrupted" if isinstance(e, KeyboardInterrupt) else "failed", str(e))
            raise
        with handling_stop_signals(self._handle):
            try:
                return self._run()
            except ArealError as e:
                # Kept in the run dir: the CLI that submitted a SLURM job shows this line; `status` reads it.
                record_node_error(self.run_dir, self.node_rank, e)
                self._write_status("failed", error=str(e))
                raise
            except KeyboardInterrupt:
                print("\n[areal] interrupted: stopping trainer and servers", file=sys.stderr, flush=True)
                self._write_status("interrupted")
                return 128 + (self._signal or signal.SIGINT)
            except BaseException as e:  # a server out of restarts, a node's user error: not left "running"
                self._write_status("failed", str(e) or type(e).__name__)
                raise
            finally:
                self.stop_all()

    def _check_trainer(self) -> bool:
        """True once the trainer exited cleanly; raises if it failed."""
        if self.trainer is None:
            return False
        code = self.trainer.poll()
        if code is None:
            dying = self.rank_logs.poll() if self.rank_logs is not None else None
            if dying is None:
                return False
            # A rank printed its last line; it and torchrun take seconds more to exit, the user need not wait
            # for that. But a peer's collective error ("Connection reset by peer") is often the echo of a rank
            # killed by a signal, which prints nothing: torchrun names that one as it exits, so give it a moment.
            # Only a death by signal overrides the dying line (which prefers a user error to a crash).
            killed = self._torchrun_culprit() if self._trainer_exit_within(_PEER_GRACE_S) is not None else None
            failure = (process_failure(*killed[:3], signal_how(killed[3])) if killed is not None and killed[3] < 0
                       else process_failure(*dying, "exit code 1"))
            self._write_status("failed", str(failure))
            raise failure
        if code == 0:
            self._write_status("done")
            return True
        failure = self._trainer_failure(code)
        self._write_status("failed", str(failure))
        raise failure

    def _run(self) -> int:
        has_trainer = self.node_rank in self.layout.trainer.node_ranks()
        started = self.start_servers()
        if not has_trainer:
            self.wait_servers(started)
            return self._serve_until_done()
        # The trainer needs minutes' worth of imports and model setup before it talks to a server,
        # so it boots while the servers load; it waits for the address book itself.
        self.start_trainer()
        self.wait_servers(started)
        self._wait_all_published()
        while True:
            self._check_signal()
            if self._check_trainer():
                return 0
            self._supervise_servers()
            if self.on_tick is not None:
                self.on_tick()
            time.sleep(self.poll_s)

    def _serve_until_done(self) -> int:
        status = Path(self.run_dir) / STATUS_FILE
        while True:
            self._check_signal()
            if status.exists():
                state = json.loads(status.read_text()).get("state")
                if state in ("done", "failed", "interrupted"):
                    return 0 if state == "done" else 1
            self._supervise_servers()
            time.sleep(self.poll_s)

    def _write_status(self, state: str, error: str | None = None) -> None:
        if self.status is not None and not self._status_ended:
            self._status_ended = True
            self.status.end(state, error)

    def stop_all(self) -> None:
        """Trainer first (it may be mid-request), then servers; each as a whole process group."""
        if self.trainer is not None and self.trainer.alive():
            self.trainer.stop(timeout=15)
        for idx, server in list(self.servers.items()):
            retract_server(self.run_dir, idx)
            if server.proc.alive():
                server.proc.stop(timeout=10)

    def _died(self, proc: ManagedProcess, hint: str = "") -> LaunchError:
        return process_failure(f"inference server {proc.name}", proc.log_path, proc.tail(80),
                               describe_exit(proc.poll()), hint=hint)


def _find_failed_rank(run_dir: str) -> tuple[str, Path, str] | None:
    """The first rank log holding a traceback: ``(who, log, tail)``."""
    best: tuple[float, str, Path, str] | None = None
    for p in sorted(logs_dir(run_dir).glob("trainer_rank*.log")):
        tail = tail_file(p, 80)
        if "Traceback" in tail or "Error" in tail:
            m = re.search(r"trainer_rank(\d+)", p.name)
            key = p.stat().st_mtime
            if best is None or key < best[0]:
                best = (key, f"trainer rank {m.group(1) if m else '?'}", p, tail)
    return best[1:] if best else None


def _torchrun_culprit(torchrun_log: str, run_dir: str, nproc: int,
                      node_index: int) -> tuple[str, Path, str, int] | None:
    """torchrun's first observed failure: ``(who, log, tail, exit code)``; a negative code is a signal
    (SIGKILL, the OOM killer), a death that leaves no traceback in the rank's log."""
    m = re.search(r"exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)", torchrun_log)
    if m is None:
        return None
    code, local, pid = int(m.group(1)), int(m.group(2)), m.group(3)
    rank = node_index * nproc + local
    log = logs_dir(run_dir) / f"trainer_rank{rank}.log"
    return f"trainer rank {rank} (pid {pid})", log, tail_file(log, 80), code


def signal_how(code: int) -> str:
    """How a process killed by signal ``-code`` ended, with the likely cause of a SIGKILL."""
    how = describe_exit(code)
    if code == -9:
        how += " — killed from outside, or by the kernel's OOM killer (check `dmesg`)"
    return how


def _server_hint(tail: str) -> str:
    if "Address already in use" in tail:
        return "the port was taken; another process started on it meanwhile. Re-run."
    if "No such file or directory" in tail or "does not appear to have a file" in tail:
        return "the model path is missing or not an HF dir (model.path)"
    if "No module named" in tail:
        return "the inference backend is not installed (see README: extras vllm / sglang)"
    if "out of memory" in tail.lower():
        return "the server ran out of memory: lower the model size or raise the TP degree"
    return ""


class LocalLauncher:
    """Everything on this machine: one node, servers + torchrun ranks."""

    name = "local"

    def preflight(self, cfg: ExperimentConfig, layout: JobLayout) -> None:
        if layout.n_nodes != 1:
            from areal_cli.config.launcher import local_multi_node

            raise LaunchError(" — fix: ".join(local_multi_node(layout.n_nodes)))

    def dry_run(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> None:
        return None

    def launch(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str, *, model_path: str | None = None,
               model_revision: str | None = None, on_tick: Callable[[], None] | None = None) -> int:
        # model_revision: unused; this machine is the only node and model_path is what it resolved
        self.preflight(cfg, layout)
        runner = NodeRunner(cfg, layout, run_dir, node_rank=0, model_path=model_path, on_tick=on_tick)
        return runner.run()


def run_node(cfg: ExperimentConfig, layout: JobLayout, run_dir: str, node_rank: int, *, master_addr: str,
             master_port: int, model_path: str | None = None, server_host: str = "127.0.0.1",
             model_revision: str | None = None) -> int:
    """Run node ``node_rank``'s share of ``layout`` and supervise it (for SLURM/SkyPilot launchers).

    Multi-node jobs must pass ``server_host`` = this node's reachable address. A hub ``model_path`` is fetched
    into this node's HF cache first (at ``model_revision``, the commit ``areal train`` pinned).
    """
    return NodeRunner(cfg, layout, run_dir, node_rank=node_rank, model_path=model_path,
                      master_addr=master_addr, master_port=master_port, server_host=server_host,
                      model_revision=model_revision).run()
