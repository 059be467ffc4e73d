"""``launcher=slurm``: one submitit job, one task per node, each running its node's share of the plan.

- The plan maps to one allocation: ``nodes`` = layout.n_nodes, one task per node (the task starts
  that node's inference servers and its torchrun trainer ranks through
  :func:`areal_cli.launchers.local.run_node`), GPUs per node, CPUs, memory, partition, account,
  QoS and the time limit from ``launcher.slurm``.
- Torch rendezvous: MASTER_ADDR is the first host of ``SLURM_JOB_NODELIST`` (``scontrol show
  hostnames``, through submitit's JobEnvironment); node 0 picks a free port and writes it to
  ``<run_dir>/slurm/rendezvous/<job>.<restart>.json``; other nodes wait for that file. It is the
  mechanism the server addresses use (the run dir's address book, :mod:`areal_cli.job.address_book`):
  the run dir is on the shared fileroot, which the storage check verifies every node sees.
- The submission environment propagates (sbatch exports it: ``HF_TOKEN``, ``HF_HOME``, ``HF_ENDPOINT``);
  ``launcher.trainer_env`` / ``server_env`` are applied by the node runner. submitit's logs go to
  ``<run_dir>/slurm/``.
- A hub ``model.path`` is fetched by each node into its HF cache before its processes start, at the commit
  ``areal train`` pinned (:mod:`areal_cli.models.hub`); a node that cannot fetch it records its one-line
  error in the run dir and the CLI shows that line.
- On preemption or timeout submitit signals the job (USR2), calls :meth:`SlurmNodeJob.checkpoint`
  and requeues it; a requeued job (``SLURM_RESTART_COUNT`` > 0, also after ``scontrol requeue``)
  runs with ``resume=auto`` and continues from the last recover checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import LaunchError, StorageError
from areal_cli.job.status import (NODE_ERRORS, TERMINAL_STATES, RunStatusWriter, read_node_error,
                                  read_status_file)
from areal_cli.job.layout import JobLayout, write_json_atomic

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

SUBMITIT_DIR = "slurm"
JOB_FILE = "slurm_job.json"


def slurm_parameters(cfg: ExperimentConfig, layout: JobLayout) -> dict[str, Any]:
    """``executor.update_parameters`` kwargs for this plan (AutoExecutor names)."""
    s = cfg.launcher.slurm
    params: dict[str, Any] = {
        "name": f"areal-{cfg.experiment_name}-{cfg.trial_name}",
        "nodes": int(layout.n_nodes),
        "tasks_per_node": 1,  # one node runner per node; it spawns servers and torchrun itself
        "cpus_per_task": int(s.cpus_per_task),
        "mem_gb": s.mem_gb,
        "timeout_min": int(s.time_min),
    }
    gpus = s.gpus_per_node if s.gpus_per_node is not None else (
        cfg.cluster.n_gpus_per_node if layout.device == "cuda" else None)
    if gpus:
        params["gpus_per_node"] = int(gpus)
    if s.partition:
        params["slurm_partition"] = s.partition
    if s.account:
        params["slurm_account"] = s.account
    if s.qos:
        params["slurm_qos"] = s.qos
    extra: dict[str, Any] = {}
    if s.requeue:
        extra["requeue"] = True
    extra.update({str(k): v for k, v in dict(s.extra_sbatch).items()})
    if extra:
        params["slurm_additional_parameters"] = extra
    if s.setup:
        params["slurm_setup"] = list(s.setup)
    return params


def srun_args_for(cfg: ExperimentConfig) -> list[str]:
    """srun flags that put a pre-launch probe step on the same partition/account."""
    s = cfg.launcher.slurm
    out = []
    if s.partition:
        out += ["--partition", s.partition]
    if s.account:
        out += ["--account", s.account]
    if s.qos:
        out += ["--qos", s.qos]
    out += ["--time", "10", "--cpus-per-task", "1", "--mem", "512M"]
    return out


def make_executor(cfg: ExperimentConfig, layout: JobLayout, run_dir: str, *, render_only: bool = False):
    """A submitit SlurmExecutor with the plan's parameters.

    ``render_only`` builds one that can write its sbatch script but not submit: submitit refuses to
    construct a SLURM executor where ``srun`` is missing, and a dry run must work on a laptop, a CI
    box or a login node before modules are loaded. Both forms translate the parameters the way
    ``submitit.AutoExecutor`` does, so the rendered script is the one a submission would write.
    """
    import submitit

    cls = _render_only_executor() if render_only else submitit.SlurmExecutor
    ex = cls(folder=str(Path(run_dir) / SUBMITIT_DIR / "%j"),
             max_num_timeout=int(cfg.launcher.slurm.max_requeues))
    params = slurm_parameters(cfg, layout)
    native = ex._convert_parameters({k: v for k, v in params.items() if not k.startswith("slurm_")})
    native.update({k[len("slurm_"):]: v for k, v in params.items() if k.startswith("slurm_")})
    ex.update_parameters(**native)
    return ex


def _render_only_executor():
    import submitit

    class RenderOnlySlurmExecutor(submitit.SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:  # constructible without srun; never used to submit
            return 2

        def _internal_process_submissions(self, delayed_submissions):
            raise LaunchError("internal: a render-only SLURM executor cannot submit")

    return RenderOnlySlurmExecutor


def render_sbatch(cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> str:
    """The sbatch script a submission of this plan writes (``run_dir`` is not created)."""
    ex = make_executor(cfg, layout, run_dir, render_only=True)
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def dry_run(cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any]:
    """What ``areal train launcher=slurm --dry-run`` shows: submitit's parameters and the sbatch script."""
    missing = missing_slurm_tools()
    return {"parameters": slurm_parameters(cfg, layout), "sbatch": render_sbatch(cfg, layout, run_dir),
            "note": (f"{', '.join(missing)} not on PATH: this machine can render the job but not submit it"
                     if missing else None)}


def _load_submitit_checkpointable():
    import submitit

    return submitit.helpers.Checkpointable


class SlurmNodeJob(_load_submitit_checkpointable()):
    """The callable submitit pickles; runs once per node (one task per node)."""

    def __init__(self, run_dir: str, config_path: str, model_path: str, layout: dict[str, Any],
                 resume: str = "none", model_revision: str = ""):
        self.run_dir, self.config_path, self.model_path = run_dir, config_path, model_path
        self.layout, self.resume, self.model_revision = layout, resume, model_revision

    def __call__(self) -> int:
        import submitit

        from areal_cli.launchers.local import run_node
        from areal_cli.config.io import load_config_file

        env = submitit.JobEnvironment()
        node_rank, n_nodes = int(env.node), int(env.num_nodes)
        job_id = str(env.job_id)
        requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        resume = "auto" if (self.resume in ("auto", "force") or requeued) else None
        cfg = load_config_file(self.config_path)
        layout = JobLayout.from_dict(self.layout)
        master_addr = env.hostnames[0] if n_nodes > 1 else "127.0.0.1"
        server_host = _reachable_address() if n_nodes > 1 else "127.0.0.1"
        # One file per job and attempt: a requeued attempt never reads the port of the one before it.
        rendezvous = rendezvous_path(self.run_dir, job_id, os.environ.get("SLURM_RESTART_COUNT", "0") or "0")
        if node_rank == 0:
            if resume == "auto":  # requeued (preemption, timeout, scontrol requeue) or resubmitted
                _switch_to_resume(cfg, self.config_path, self.run_dir)
            from areal_cli.utils.network import find_free_port

            port = find_free_port("0.0.0.0" if n_nodes > 1 else "127.0.0.1")
            write_json_atomic(rendezvous, {"addr": master_addr, "port": port})
        else:
            port = int(wait_rendezvous(rendezvous, timeout_s=600)["port"])
            cfg = load_config_file(self.config_path)  # node 0 may have switched it to resume=auto
        print(f"[areal] slurm job {job_id} node {node_rank}/{n_nodes} on {env.hostname}: master "
              f"{master_addr}:{port}, resume={cfg.resume}", flush=True)
        code = run_node(cfg, layout, self.run_dir, node_rank, master_addr=master_addr, master_port=port,
                        model_path=self.model_path, server_host=server_host,
                        model_revision=getattr(self, "model_revision", ""))
        if code != 0:
            raise LaunchError(f"node {node_rank} of slurm job {job_id} ended with code {code}; "
                              f"logs in {self.run_dir}/logs")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit on preemption/timeout before requeueing: resume from the last recover."""
        import submitit

        return submitit.helpers.DelayedSubmission(
            SlurmNodeJob(self.run_dir, self.config_path, self.model_path, self.layout, resume="auto",
                         model_revision=getattr(self, "model_revision", "")))


def rendezvous_path(run_dir: str, job_id: str, restart: str) -> Path:
    """Where node 0 of one attempt of a job publishes the torch rendezvous (master address and port)."""
    return Path(run_dir) / "slurm" / "rendezvous" / f"{job_id}.{restart}.json"


def wait_rendezvous(path: Path, timeout_s: float, poll_s: float = 0.2) -> dict[str, Any]:
    """Node 0's rendezvous record, once it is there (it is written atomically, so a read is whole)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise LaunchError(f"node 0 did not publish the torch rendezvous ({path}) within "
                                  f"{timeout_s:.0f}s; the run dir seems not shared between nodes — fix: put "
                                  "cluster.fileroot on a filesystem every node shares (areal check-storage)"
                                  ) from None
            time.sleep(poll_s)


def _reachable_address() -> str:
    import socket

    from areal_cli.utils.network import local_ip

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return local_ip()


def _switch_to_resume(cfg: ExperimentConfig, config_path: str, run_dir: str) -> None:
    """Rewrite the run's config with resume=auto and drop the dead attempt's live state.

    Its server records and status file describe processes that no longer exist; left in place they
    would hand the new trainer dead addresses.
    """
    import shutil

    from areal_cli.config.io import save_config

    if cfg.resume not in ("auto", "force"):  # the name stays: config.yaml holds the one the CLI chose
        cfg.resume = "auto"
        save_config(cfg, config_path)
    for name in ("status.json", "servers", NODE_ERRORS):
        q = Path(run_dir) / name
        if q.is_dir():
            shutil.rmtree(q, ignore_errors=True)
        elif q.exists():
            q.unlink()


def squeue_state(job_id: str) -> str | None:
    """The job's state from squeue, or None once it left the queue (sacct may not exist)."""
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    if r.returncode != 0:
        return None if "Invalid job id" in r.stderr else "UNKNOWN"
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    return lines[0] if lines else None


class SlurmLauncher:
    """Submit the plan as one SLURM job through submitit and wait for it."""

    name = "slurm"
    fetches_model_on_nodes = True  # each node fetches a hub model into its HF cache (NodeRunner.fetch_model)

    def preflight(self, cfg: ExperimentConfig, layout: JobLayout) -> None:
        _require_slurm()

    def dry_run(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any]:
        return dry_run(cfg, layout, run_dir)

    def launch(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str, *, model_path: str | None = None,
               on_tick: Callable[[], None] | None = None, poll_s: float = 2.0,
               model_revision: str = "") -> int:
        _require_slurm()
        if layout.n_nodes > 1 and not cfg.skip_storage_check:
            self._cross_node_storage_check(cfg)
        config_path = os.path.join(run_dir, "config.yaml")
        job_fn = SlurmNodeJob(run_dir, config_path, model_path or cfg.model.path, layout.to_dict(),
                              resume=str(cfg.resume), model_revision=model_revision)
        ex = make_executor(cfg, layout, run_dir)
        try:
            job = ex.submit(job_fn)
        except Exception as e:  # noqa: BLE001 - sbatch rejections come back as submitit errors
            raise LaunchError(f"sbatch refused the job: {e}".strip() + " — fix: check launcher.slurm "
                              "(partition, account, cpus_per_task, mem_gb, time_min) against sinfo") from e
        job_id = str(job.job_id)
        Path(run_dir, JOB_FILE).write_text(json.dumps({"job_id": job_id, "submitted": time.time(),
                                                       "params": slurm_parameters(cfg, layout)}, default=str))
        print(f"[areal] submitted slurm job {job_id} ({layout.n_nodes} node(s)); submitit logs in "
              f"{run_dir}/{SUBMITIT_DIR}/{job_id}", file=sys.stderr, flush=True)
        try:
            return self._wait(job, job_id, run_dir, on_tick, poll_s)
        except KeyboardInterrupt:
            subprocess.run(["scancel", job_id], check=False)
            if read_status_file(run_dir).get("state") not in TERMINAL_STATES:  # cancelled before it started
                RunStatusWriter(run_dir, "slurm", slurm_job=job_id).end("interrupted")
            print(f"\n[areal] interrupted: cancelled slurm job {job_id}", file=sys.stderr, flush=True)
            return 130

    def _wait(self, job: Any, job_id: str, run_dir: str, on_tick: Callable[[], None] | None,
              poll_s: float) -> int:
        while True:
            state = squeue_state(job_id)
            if on_tick is not None:
                on_tick()
            if state is None:
                break
            time.sleep(poll_s)
        if on_tick is not None:
            on_tick()
        status = _run_status(run_dir)
        try:
            job.result()
        except Exception as e:  # noqa: BLE001 - submitit re-raises the node's failure or the cancellation
            from areal_cli.launchers.failures import process_failure
            from areal_cli.launchers.local import _find_failed_rank

            # A node's own line: its runner's failure (a rank's error, a server out of restarts, a hub model
            # it could not fetch), the one the local launcher shows.
            node_error = read_node_error(run_dir)
            if node_error is not None:
                node_error.details = [*getattr(node_error, "details", []),  # type: ignore[attr-defined]
                                      f"submitit logs: {run_dir}/{SUBMITIT_DIR}/{job_id}"]
                raise node_error from None
            found = _find_failed_rank(run_dir)  # the node runner itself died (killed, out of memory)
            if found is not None:
                err = process_failure(*found, "exit code 1")
            else:
                err = LaunchError(f"slurm job {job_id} failed (run status: {status or 'none'}): "
                                  f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}")
            err.details = [*err.details, f"submitit logs: {run_dir}/{SUBMITIT_DIR}/{job_id}"]
            raise err from None
        if status != "done":
            raise LaunchError(f"slurm job {job_id} ended but the run status is {status or 'missing'}; "
                              f"see {run_dir}/logs")
        return 0

    def _cross_node_storage_check(self, cfg: ExperimentConfig) -> None:
        from areal_cli.storage import estimate_run_bytes, run_storage_check, storage_paths_for

        rep = run_storage_check(storage_paths_for(cfg), int(cfg.cluster.n_nodes), use_srun=True,
                                srun_args=srun_args_for(cfg), required_bytes=estimate_run_bytes(cfg),
                                throughput_bytes=0)
        if not rep.ok:
            raise StorageError("the cross-node storage check failed, refusing to submit:\n" + rep.summary()
                               + "\n(set skip_storage_check=true to submit anyway)")


def _run_status(run_dir: str) -> str | None:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text()).get("state")
    except (OSError, ValueError):
        return None


SLURM_TOOLS = ("sbatch", "srun", "squeue", "scancel")


def missing_slurm_tools() -> list[str]:
    import shutil

    return [c for c in SLURM_TOOLS if shutil.which(c) is None]


def _require_slurm() -> None:
    missing = missing_slurm_tools()
    if missing:
        raise LaunchError(f"launcher=slurm needs the SLURM client tools, but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not on PATH — fix: run on a SLURM login "
                          "node (module load slurm), or start the local test cluster with "
                          "`sudo bash slurm/local-cluster.sh`; `areal train launcher=slurm --dry-run` "
                          "prints the sbatch script without them")
