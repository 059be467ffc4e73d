"""``launcher`` group: where processes run (local, SLURM through submitit, SkyPilot, Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged

MULTI_NODE_LAUNCHERS = "launcher=slurm, launcher=ray or launcher=skypilot"


def local_multi_node(n_nodes: int) -> tuple[str, str]:
    """(reason, fix) for a plan of several nodes under launcher=local: the plan warning and the launch refusal
    say the same thing. The local launcher starts processes on this machine only; nothing places them on
    other hosts (there is no host-list knob to set)."""
    return (f"launcher=local runs on this machine alone, but the plan needs {n_nodes} nodes "
            f"(cluster.n_nodes={n_nodes})",
            f"use a launcher that starts every node ({MULTI_NODE_LAUNCHERS}), or set cluster.n_nodes=1")


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = ranged(60, ge=1)
    cpus_per_task: int = ranged(2, ge=1)
    mem_gb: int = ranged(16, ge=1)
    gpus_per_node: int | None = ranged(None, ge=0, why="null uses cluster.n_gpus_per_node")
    requeue: bool = True
    max_requeues: int = ranged(3, ge=0)
    extra_sbatch: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)  # shell lines run before the job


@dataclass
class SkyPilotConfig:
    cloud: str | None = None
    accelerators: str | None = None  # None → derived from the plan (e.g. "H100:8")
    region: str | None = None
    use_spot: bool = False
    cluster_name: str | None = None
    setup: str = "pip install torch==2.13.0 && pip install -e ."
    workdir: str = "."
    file_mounts: dict[str, str] = field(default_factory=dict)


@dataclass
class RayConfig:
    # "auto": the running cluster (RAY_ADDRESS, else the one started on this machine by `ray start`);
    # "host:port": that cluster's GCS; "local": start a one-node cluster for this run.
    address: str = "auto"
    namespace: str = "areal"
    cpus_per_gpu: float = ranged(1.0, ge=0.0, why="CPUs reserved beside each GPU on CUDA clusters")
    # Only nodes carrying all these labels (`ray start --labels`) take part; e.g. {"pool": "rl"}.
    node_labels: dict[str, str] = field(default_factory=dict)
    placement_timeout_s: float = ranged(120.0, gt=0.0, why="how long to wait for the placement groups")
    local_num_cpus: int | None = ranged(None, ge=1, why="null: Ray counts this machine's cores")


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm | skypilot | ray
    server_startup_timeout_s: float = ranged(300.0, gt=0.0)
    restart_dead_servers: bool = True
    max_server_restarts: int = ranged(3, ge=0)
    trainer_env: dict[str, str] = field(default_factory=dict)
    server_env: dict[str, str] = field(default_factory=dict)
    # Extra command-line flags for every inference server, appended last (so they override the
    # launcher's own), e.g. ["--mem-fraction-static", "0.8", "--trust-remote-code"] for SGLang.
    server_args: list[str] = field(default_factory=list)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    skypilot: SkyPilotConfig = field(default_factory=SkyPilotConfig)
    ray: RayConfig = field(default_factory=RayConfig)
