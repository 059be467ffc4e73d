"""``launcher=ray``: run the plan on a Ray cluster, each process a Ray actor placed by the plan.

- Connects to ``launcher.ray.address`` ("auto", "host:port", or "local" to start a one-node cluster),
  matches every plan node to a Ray node and creates one placement group per component
  (:mod:`areal_cli.launchers.ray_placement`). A plan the cluster cannot hold fails in ``preflight``,
  before the model or the run dir is touched, with one line naming the shortfall.
- Before launch, the storage probe (:mod:`areal_cli.storage.node_probe`) runs as one Ray task per node of
  the cluster (pinned by node affinity), so a fileroot that one node does not share is named.
- Each inference server and each trainer rank is a :class:`ProcessHost` actor in its bundle; the actor
  starts the process on its node (the same command lines as ``launcher=local``) and the process dies
  with the actor (``PR_SET_PDEATHSIG``). torch.distributed rendezvous: the driver asks rank 0's actor
  for its node IP and a free port there and hands both to every rank (``MASTER_ADDR``/``MASTER_PORT``,
  ``RANK``, ``LOCAL_RANK``, ...); no torchrun. Server addresses go through the run dir's address book,
  as under the other launchers.
- Supervision, as ``launcher=local``: a dead server (its process, or its actor) is replaced by a new
  actor in the same bundle on a fresh port and re-published with a higher epoch (clients re-read the
  address book and re-route); a dead trainer rank stops everything and the error names the rank, the
  Ray node it ran on and its log tail; Ctrl-C/SIGTERM stop every actor and remove the placement
  groups. If the driver itself dies, Ray ends the job's actors and placement groups (none is detached).
- ``<run_dir>/ray_placement.json`` records which Ray node runs each process.
- A hub ``model.path`` is fetched before anything is reserved: one Ray task per node of the plan, pinned to
  it, downloads into that node's HF cache (its raylet's ``HF_HOME``; ``HF_TOKEN``/``HF_ENDPOINT`` are
  passed from the driver); each process gets its node's snapshot dir.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import LaunchError, StorageError
from areal_cli.job.address_book import retract_server
from areal_cli.job.status import RunStatusWriter, error_from_record, error_record
from areal_cli.job.layout import MODEL_PATH_ENV, SERVER_KEY_ENV, JobLayout, ServerSpec, write_json_atomic
from areal_cli.launchers.ray_placement import (
    GroupSpec,
    RayNode,
    assign_nodes,
    describe_assignment,
    nodes_from_ray,
    placement_groups,
)
from areal_cli.launchers.supervisor import ServerSupervisor
from areal_cli.utils.procs import handling_stop_signals

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

PLACEMENT_FILE = "ray_placement.json"


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise LaunchError(
            f"launcher=ray needs Ray, which is not installed ({e}) — fix: "
            "pip install 'areal-cli[ray]' (the same Ray version as the cluster)"
        ) from None
    return ray


# ---------------------------------------------------------------- the actor (runs on a Ray node)


class ProcessHost:
    """Runs one process (an inference server or a trainer rank) on the node Ray placed this actor on.

    Every method returns at once (the driver polls), so the actor needs no threads: the process is
    forked from the actor's main thread, which ``PR_SET_PDEATHSIG`` ties it to.
    """

    def __init__(self, name: str, log_path: str):
        self.name, self.log_path = name, log_path
        self.proc: Any = None

    def where(self) -> dict[str, Any]:
        import socket

        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "actor_pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        import ray

        from areal_cli.utils.network import find_free_port

        return find_free_port(ray.util.get_node_ip_address())

    def _start(self, argv: list[str], env: dict[str, str]) -> int:
        from areal_cli.utils.procs import ManagedProcess

        self.proc = ManagedProcess(
            name=self.name, argv=argv, log_path=self.log_path, env=env, die_with_parent=True
        ).start()
        return int(self.proc.pid)

    def start_server(
        self, config_path: str, spec: dict[str, Any], model_path: str, run_dir: str, device: str, api_key: str
    ) -> tuple[str, int]:
        """Start the server on a free port of this node's IP (the trainer may be elsewhere), with the
        run's api key; returns ``(address, pid)``."""
        import ray

        from areal_cli.launchers.local import base_env, server_argv
        from areal_cli.config.io import load_config_file
        from areal_cli.utils.network import find_free_port

        cfg = load_config_file(config_path)
        host = ray.util.get_node_ip_address()
        port = find_free_port(host)
        env = base_env(device)  # on CUDA, Ray's CUDA_VISIBLE_DEVICES (this actor's GPUs) stays
        server = ServerSpec(**spec)
        argv, cmd_env = server_argv(cfg, server, port, model_path, host, run_dir)
        env.update(cmd_env)
        env[SERVER_KEY_ENV] = api_key  # the hf server reads it from here, so no log shows it
        if server.backend != "hf":
            argv += ["--api-key", api_key]
        env.update({k: str(v) for k, v in cfg.launcher.server_env.items()})
        return f"{host}:{port}", self._start(argv, env)

    def start_rank(self, config_path: str, env: dict[str, str]) -> int:
        return self._start([sys.executable, "-m", "areal_cli.trainer.entry", "--config", config_path], env)

    def healthy(self, address: str) -> bool:
        import httpx

        try:
            return httpx.get(f"http://{address}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = 10.0) -> int | None:
        return None if self.proc is None else self.proc.stop(timeout=timeout)

    def tail(self, n: int = 30) -> str:
        return "" if self.proc is None else self.proc.tail(n)


# ---------------------------------------------------------------- the driver


def connect(cfg: ExperimentConfig) -> Any:
    """``ray.init`` for ``launcher.ray``; a :class:`LaunchError` when no cluster answers."""
    ray = _import_ray()
    rc = cfg.launcher.ray
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"namespace": rc.namespace, "log_to_driver": False, "logging_level": "warning"}
    if rc.address == "local":
        kwargs.update(address="local", include_dashboard=False)
        if rc.local_num_cpus is not None:
            kwargs["num_cpus"] = int(rc.local_num_cpus)
    else:
        kwargs["address"] = rc.address
    try:
        if rc.address != "local":
            _probe_gcs(rc.address)
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LaunchError(
            f"launcher=ray cannot reach a Ray cluster at launcher.ray.address={rc.address} "
            f"({first}) — fix: start one (`ray start --head`), set launcher.ray.address=HOST:PORT, "
            "or launcher.ray.address=local to start one for this run"
        ) from None
    return ray


def _probe_gcs(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once when nothing listens at the cluster's GCS: ``ray.init`` would retry for minutes."""
    import socket

    # Ray's own resolution of "auto" (RAY_ADDRESS, then the cluster `ray start` recorded here).
    from ray._private.services import canonicalize_bootstrap_address

    target = canonicalize_bootstrap_address(address)
    if not target or "://" in target:
        return
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {target}: {e.strerror or e}") from None


def cluster_nodes(cfg: ExperimentConfig) -> list[RayNode]:
    ray = _import_ray()
    return nodes_from_ray(ray.nodes(), dict(cfg.launcher.ray.node_labels))


def _probe_on_node(
    paths: list[str],
    expect: int,
    session: str,
    timeout_s: float,
    node_key: str,
    required_bytes: int,
    throughput_bytes: int,
) -> tuple[int, str, str]:
    """A Ray task: the storage probe as a subprocess of this node's worker."""
    import subprocess

    from areal_cli.storage.crossnode import probe_argv

    argv = probe_argv(
        paths,
        expect=expect,
        session=session,
        timeout_s=timeout_s,
        node_id=node_key,
        required_bytes=required_bytes,
        throughput_bytes=throughput_bytes,
        python=sys.executable,
    )
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s * 2 + 120)
    except subprocess.TimeoutExpired:
        return 124, "", "probe timed out"
    return r.returncode, r.stdout, r.stderr


def _fetch_on_node(model_path: str, revision: str, hub_env: dict[str, str]) -> dict[str, Any]:
    """A Ray task: the hub model in this node's HF cache (the node's ``HF_HOME``), downloaded once per node.
    A user error comes back as a record: ConfigError does not survive Ray's pickling."""
    from areal_cli.errors import ArealError
    from areal_cli.models.hub import ensure_hub_model

    try:
        return {"path": ensure_hub_model(model_path, revision or None, token=hub_env.get("HF_TOKEN"),
                                         endpoint=hub_env.get("HF_ENDPOINT"))}
    except ArealError as e:
        return {"error": error_record(e)}


def ray_storage_check(
    cfg: ExperimentConfig, nodes: list[RayNode], *, timeout_s: float = 20.0,
    throughput_bytes: int = 8 * 1024 * 1024
) -> Any:
    """Cross-node storage check of ``cluster.fileroot``: one probe task per Ray node; the report."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from areal_cli.storage.crossnode import ProbeRun, _cleanup, _parse, _tail, evaluate
    from areal_cli.storage.estimate import estimate_run_bytes
    from areal_cli.storage.report import StorageReport

    ray = _import_ray()
    paths = [
        os.path.abspath(os.path.expanduser(p)) for p in [cfg.cluster.fileroot] if not p.startswith("s3://")
    ]
    report = StorageReport()
    if not paths:
        return report
    session = uuid.uuid4().hex[:12]
    task = ray.remote(num_cpus=0, max_retries=0)(_probe_on_node)
    refs = {
        n.key: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote(
            paths, len(nodes), session, timeout_s, n.key, int(estimate_run_bytes(cfg)), int(throughput_bytes)
        )
        for n in nodes
    }
    run = ProbeRun()
    for key, ref in refs.items():
        try:
            code, out, err = ray.get(ref, timeout=timeout_s * 2 + 180)
        except Exception as e:  # noqa: BLE001 - the node died or its worker could not start
            run.errors[key] = (
                f"the probe task failed: {(str(e).strip().splitlines() or [type(e).__name__])[-1]}"
            )
            continue
        parsed = _parse(out)
        if parsed:
            run.results[key] = parsed[0]
        else:
            run.errors[key] = f"probe failed (exit {code}): {_tail(err or out) or 'no output'}"
    _cleanup(paths, session)
    report.extend(evaluate(run, paths, expected_nodes=list(refs)))
    return report


@dataclass
class _Proc:
    """The driver's view of one actor-hosted process."""

    name: str
    actor: Any
    where: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    address: str | None = None
    epoch: int = 0
    spec: ServerSpec | None = None
    rank: int | None = None


class RayJob(ServerSupervisor):
    """One run on the cluster: placement groups, actors, supervision, teardown. Server supervision is
    :class:`~areal_cli.launchers.supervisor.ServerSupervisor`'s, shared with the per-node runner."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        layout: JobLayout,
        run_dir: str,
        assignment: dict[int, RayNode],
        *,
        model_path: str | None = None,
        on_tick: Callable[[], None] | None = None,
        poll_s: float = 0.5,
        model_revision: str | None = None,
    ):
        self.ray = _import_ray()
        self.cfg, self.layout, self.run_dir = cfg, layout, str(run_dir)
        self.assignment = assignment
        self.model_path = model_path or cfg.model.path
        self.model_revision = model_revision if model_revision is not None else cfg.model.revision
        self.node_models: dict[str, str] = {}  # Ray node id → the model dir there (a hub id's snapshot)
        self.config_path = os.path.join(self.run_dir, "config.yaml")
        self.on_tick, self.poll_s = on_tick, poll_s
        self.rc = cfg.launcher.ray
        self.groups: dict[str, tuple[GroupSpec, Any]] = {}
        self.servers: dict[int, _Proc] = {}
        self.ranks: list[_Proc] = []
        self.restarts = 0
        self.prefix = f"areal:{cfg.experiment_name}/{cfg.trial_name}"
        # Servers listen on their node's IP, reachable from the other nodes: only this run's trainer,
        # which gets the key from the driver, may use them.
        self.api_key = secrets.token_hex(16)
        self._signal: int | None = None
        self.status = RunStatusWriter(self.run_dir, "ray")
        self._status_ended = False

    # ------------------------------------------------------------------ placement
    def _create_groups(self) -> None:
        from ray.util.placement_group import placement_group

        for g in placement_groups(self.layout, self.rc.cpus_per_gpu):
            pg = placement_group(
                g.bundles,
                strategy=g.strategy,
                name=f"{self.prefix}:{g.name}",
                bundle_label_selector=g.selectors(self.assignment),
            )
            self.groups[g.name] = (g, pg)
        for name, (g, pg) in self.groups.items():
            try:
                self.ray.get(pg.ready(), timeout=float(self.rc.placement_timeout_s))
            except self.ray.exceptions.GetTimeoutError:
                nodes = sorted({self.assignment[n].label for n in g.plan_nodes})
                raise LaunchError(
                    f"Ray could not reserve the {name} placement group ({len(g.bundles)} bundles "
                    f"on {', '.join(nodes)}) within {self.rc.placement_timeout_s:.0f}s "
                    "(launcher.ray.placement_timeout_s): other jobs hold those resources; "
                    "see `ray status`"
                ) from None

    def _actor(self, name: str, group: str, bundle: int, proc_name: str) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec, pg = self.groups[group]
        res = spec.bundles[bundle]
        cls = self.ray.remote(ProcessHost)
        return cls.options(
            name=f"{self.prefix}:{name}",
            namespace=self.rc.namespace,
            max_restarts=0,
            max_concurrency=1,
            num_cpus=res.get("CPU", 0.0),
            num_gpus=res.get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(proc_name, str(Path(self.run_dir) / "logs" / f"{proc_name}.log"))

    def _node_label(self, where: dict[str, Any]) -> str:
        for n in self.assignment.values():
            if n.node_id == where.get("node_id"):
                return n.label
        return f"ray node {str(where.get('node_id', '?'))[:8]} (ip {where.get('ip', '?')})"

    def _record(self) -> None:
        procs = {
            p.name: {
                **p.where,
                "pid": p.pid,
                "epoch": p.epoch,
                "node": self._node_label(p.where),
                **({"address": p.address} if p.address else {}),
            }
            for p in [*self.servers.values(), *self.ranks]
        }
        write_json_atomic(
            Path(self.run_dir) / PLACEMENT_FILE,
            {
                "plan_nodes": {
                    str(k): {"node_id": n.node_id, "name": n.key, "ip": n.ip}
                    for k, n in self.assignment.items()
                },
                "groups": {name: g.to_dict(self.assignment) for name, (g, _) in self.groups.items()},
                "processes": procs,
            },
        )

    # ------------------------------------------------------------------ the model
    def _fetch_model(self) -> None:
        """A hub id: one download per Ray node of the plan, each a task pinned to its node, before any
        resources are reserved; ``HF_TOKEN``/``HF_ENDPOINT`` go from this process to the tasks (a Ray worker
        has its raylet's environment, not the driver's)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from areal_cli.models.hub import is_hub_id

        if not is_hub_id(self.model_path):
            return
        hub_env = {k: os.environ[k] for k in ("HF_TOKEN", "HF_ENDPOINT") if os.environ.get(k)}
        task = self.ray.remote(num_cpus=0, max_retries=0)(_fetch_on_node)
        nodes = {n.node_id: n for n in self.assignment.values()}
        refs = {nid: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(
            self.model_path, self.model_revision or "", hub_env) for nid in nodes}
        for nid, ref in refs.items():
            try:
                out = self.ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the node died or its worker could not start
                first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                raise LaunchError(
                    f"fetching {self.model_path} on {nodes[nid].label} failed: {first}"
                ) from None
            if "error" in out:
                raise error_from_record(out["error"], where=f"{nodes[nid].label}: ")
            self.node_models[nid] = out["path"]

    def _model_on(self, where: dict[str, Any]) -> str:
        return self.node_models.get(str(where.get("node_id")), self.model_path)

    # ------------------------------------------------------------------ servers
    def _spawn_server(self, spec: ServerSpec, epoch: int) -> _Proc:
        actor = self._actor(f"{spec.name}#{epoch}", "inference", spec.index, spec.name)
        p = _Proc(spec.name, actor, epoch=epoch, spec=spec)
        p.where = self.ray.get(actor.where.remote(), timeout=float(self.rc.placement_timeout_s))
        p.address, p.pid = self.ray.get(
            actor.start_server.remote(
                self.config_path,
                asdict(spec),
                self._model_on(p.where),
                self.run_dir,
                self.layout.device,
                self.api_key,
            ),
            timeout=120,
        )
        self.servers[spec.index] = p
        return p

    def _server_exit(self, p: _Proc) -> str | None:
        """Why the server is gone ('killed by SIGKILL', 'its Ray actor died'), or None while it serves."""
        from areal_cli.utils.procs import describe_exit

        try:
            code = self.ray.get(p.actor.poll.remote(), timeout=60)
        except self.ray.exceptions.RayActorError:
            return "its Ray actor died"
        return None if code is None else describe_exit(code)

    def _server_healthy(self, p: _Proc) -> bool:
        return bool(self.ray.get(p.actor.healthy.remote(p.address), timeout=60))

    def _stop_server(self, p: _Proc) -> None:
        self._kill(p)

    def _check_workers(self) -> bool:
        return self._check_ranks()

    def _server_failed(self, p: _Proc, why: str) -> LaunchError:
        from areal_cli.launchers.failures import process_failure
        from areal_cli.launchers.local import _server_hint

        tail = self.ray.get(p.actor.tail.remote(80), timeout=60)
        return process_failure(f"inference server {p.name} on {self._node_label(p.where)}",
                               f"{self.run_dir}/logs/{p.name}.log", tail, why, hint=_server_hint(tail))

    def _server_not_ready(self, p: _Proc) -> LaunchError:
        return LaunchError(
            f"{p.name} did not become ready within {self.cfg.launcher.server_startup_timeout_s:.0f}s "
            f"(launcher.server_startup_timeout_s) on {self._node_label(p.where)}; see "
            f"{self.run_dir}/logs/{p.name}.log"
        )

    def _out_of_restarts(self, p: _Proc, why: str, limit: int) -> LaunchError:
        return LaunchError(
            f"inference server {p.name} on {self._node_label(p.where)} died ({why}); restarts "
            f"used: {self.restarts}/{limit} (launcher.max_server_restarts). Log "
            f"{self.run_dir}/logs/{p.name}.log"
        )

    def _restart_line(self, p: _Proc, why: str, limit: int) -> str:
        return (f"[areal] {p.name} on {self._node_label(p.where)} died ({why}); restarting "
                f"({self.restarts}/{limit}) as a new Ray actor. Log: {self.run_dir}/logs/{p.name}.log")

    def _after_restart(self) -> None:
        self._record()

    # ------------------------------------------------------------------ trainer
    def _start_trainer(self) -> None:
        t = self.layout.trainer
        world = t.world_size
        self.ranks = [
            _Proc(
                f"trainer_rank{r}", self._actor(f"trainer_rank{r}", "trainer", r, f"trainer_rank{r}"), rank=r
            )
            for r in range(world)
        ]
        wheres = self.ray.get(
            [p.actor.where.remote() for p in self.ranks], timeout=float(self.rc.placement_timeout_s)
        )
        for p, w in zip(self.ranks, wheres):
            p.where = w
        master_addr = wheres[0]["ip"]
        master_port = self.ray.get(self.ranks[0].actor.free_port.remote(), timeout=60)
        on_node: dict[str, list[int]] = {}
        for r, w in enumerate(wheres):
            on_node.setdefault(w["node_id"], []).append(r)
        node_order = list(on_node)
        from areal_cli.launchers.local import base_env

        refs = []
        for r, p in enumerate(self.ranks):
            local = on_node[p.where["node_id"]]
            env = base_env(self.layout.device)
            env.update(
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local.index(r)),
                    "LOCAL_WORLD_SIZE": str(len(local)),
                    "GROUP_RANK": str(node_order.index(p.where["node_id"])),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    SERVER_KEY_ENV: self.api_key,
                    MODEL_PATH_ENV: self._model_on(p.where),
                }
            )
            if self.layout.device == "cuda":
                # Every rank on a node sees the node's trainer GPUs; LOCAL_RANK picks its own.
                env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    g for q in local for g in self.ranks[q].where["gpu_ids"]
                )
            env.update({k: str(v) for k, v in self.cfg.launcher.trainer_env.items()})
            refs.append(p.actor.start_rank.remote(self.config_path, env))
        for p, pid in zip(self.ranks, self.ray.get(refs, timeout=120)):
            p.pid = pid
        print(
            f"[areal] trainer: {world} rank(s) as Ray actors, rendezvous {master_addr}:{master_port}",
            file=sys.stderr,
            flush=True,
        )

    def _check_ranks(self) -> bool:
        """True once every rank exited 0; raises naming the first failed rank."""
        from areal_cli.utils.procs import describe_exit, tail_file

        if not self.ranks:
            return False
        refs = [p.actor.poll.remote() for p in self.ranks]
        failed: list[tuple[int, _Proc, str]] = []  # (priority, rank, how)
        done = 0
        for p, ref in zip(self.ranks, refs):
            try:
                code = self.ray.get(ref, timeout=60)
            except self.ray.exceptions.RayActorError:
                failed.append((0, p, "its Ray actor died"))
                continue
            if code == 0:
                done += 1
            elif code is not None:
                # A rank killed by a signal leaves no traceback; its peers then fail with collective
                # errors that do. The signalled one is the cause.
                failed.append((1 if code < 0 else 2, p, describe_exit(code)))
        if failed:
            from areal_cli.launchers.failures import process_failure

            _, p, how = min(failed, key=lambda f: (f[0], f[1].rank))
            log = Path(self.run_dir) / "logs" / f"{p.name}.log"
            failure = process_failure(f"trainer rank {p.rank} on {self._node_label(p.where)}", log,
                                      tail_file(log, 80), how)
            self._write_status("failed", str(failure))
            raise failure
        return done == len(self.ranks)

    # ------------------------------------------------------------------ run
    def _handle(self, signum: int, _frame: Any) -> None:
        self._signal = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def _write_status(self, state: str, error: str | None = None) -> None:
        if not self._status_ended:
            self._status_ended = True
            self.status.end(state, error)

    def run(self) -> int:
        # SIGINT too, not Python's default handler: its KeyboardInterrupt can be raised inside Ray's own
        # calls and swallowed there (a Ctrl-C once went unseen and the run went on to its end). Ours also
        # records the signal, which the supervision loop re-checks every tick.
        self.status.start()
        with handling_stop_signals(self._handle):
            try:
                return self._run()
            except LaunchError as e:
                self._write_status("failed", str(e))  # a server out of restarts, a rank dead, a group not placed
                raise
            except KeyboardInterrupt:
                print("\n[areal] interrupted: stopping the Ray actors (trainer ranks, then servers)",
                      file=sys.stderr, flush=True)
                self._write_status("interrupted")
                return 128 + (self._signal or signal.SIGINT)
            except BaseException as e:  # a node's user error (a hub model it could not fetch): not left running
                self._write_status("failed", str(e) or type(e).__name__)
                raise
            finally:
                self.teardown()

    def _run(self) -> int:
        self._fetch_model()
        self._create_groups()
        where = describe_assignment(self.layout, self.assignment, self.rc.cpus_per_gpu)
        print(f"[areal] ray placement: {where}", file=sys.stderr, flush=True)
        started = [self._spawn_server(s, 0) for s in self.layout.servers]
        self._start_trainer()  # it boots while the servers load, and waits for the address book
        self._record()
        for p in started:
            self._wait_ready(p)
        while True:
            self._check_signal()
            if self._check_ranks():
                self._write_status("done")
                return 0
            self._supervise_servers()
            if self.on_tick is not None:
                self.on_tick()
            time.sleep(self.poll_s)

    def _kill(self, p: _Proc) -> None:
        try:
            self.ray.kill(p.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    def teardown(self) -> None:
        """Trainer ranks first (they may be mid-request), then servers; then the actors and groups."""
        for batch in (self.ranks, list(self.servers.values())):
            refs = [p.actor.stop.remote(10.0) for p in batch]
            if refs:
                self.ray.wait(refs, num_returns=len(refs), timeout=30)
            for p in batch:
                self._kill(p)
        for idx in list(self.servers):
            retract_server(self.run_dir, idx)
        from ray.util.placement_group import remove_placement_group

        for _, pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - gone with the job
                pass


class RayLauncher:
    """Run the plan on a Ray cluster. See the module docstring."""

    name = "ray"
    fetches_model_on_nodes = True  # RayJob._fetch_model: one download per Ray node, into its HF cache

    def __init__(self) -> None:
        self.assignment: dict[int, RayNode] | None = None
        self.nodes: list[RayNode] = []

    def preflight(self, cfg: ExperimentConfig, layout: JobLayout) -> None:
        if layout.colocated:
            raise LaunchError(
                "launcher=ray places inference and training on separate devices ('+' in "
                "allocation_mode), and this plan is colocated ('|') — fix: use launcher=local or "
                "launcher=slurm, or separate the components with '+'"
            )
        ray = connect(cfg)
        try:
            self.nodes = cluster_nodes(cfg)
            self.assignment = assign_nodes(
                layout,
                self.nodes,
                cpus_per_gpu=float(cfg.launcher.ray.cpus_per_gpu),
                where=cfg.launcher.ray.address,
            )
        except BaseException:
            ray.shutdown()
            raise

    def dry_run(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any]:
        groups = [g.to_dict() for g in placement_groups(layout, float(cfg.launcher.ray.cpus_per_gpu))]
        return {
            "placement_groups": groups,
            "text": json.dumps({"placement_groups": groups}, indent=1),
            "note": (
                f"at launch each plan node is matched to a Ray node of the cluster at "
                f"launcher.ray.address={cfg.launcher.ray.address}; bundles are pinned by ray.io/node-id"
            ),
        }

    def launch(
        self,
        cfg: ExperimentConfig,
        layout: JobLayout,
        run_dir: str,
        *,
        model_path: str | None = None,
        on_tick: Callable[[], None] | None = None,
        model_revision: str | None = None,
    ) -> int:
        if self.assignment is None:
            self.preflight(cfg, layout)
        assert self.assignment is not None
        ray = _import_ray()
        try:
            if not cfg.skip_storage_check:
                rep = ray_storage_check(cfg, self.nodes)
                if not rep.ok:
                    raise StorageError(
                        "the storage check on every Ray node failed, refusing to launch:\n"
                        + rep.summary()
                        + "\n(set skip_storage_check=true to launch anyway)"
                    )
            return RayJob(cfg, layout, run_dir, self.assignment, model_path=model_path, on_tick=on_tick,
                          model_revision=model_revision).run()
        finally:
            ray.shutdown()
