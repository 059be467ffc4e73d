"""``cluster`` group: the hardware the allocation is placed on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterConfig:
    n_nodes: int = 1
    n_gpus_per_node: int = 2  # on cpu: processes ("devices") per node
    device: str = "cpu"  # cpu | cuda
    gpu_memory_gb: float = 80.0
    fileroot: str = "~/.cache/areal"
    hosts: list[str] = field(default_factory=list)  # explicit host list (non-SLURM multi-node)
    name_resolve: str = "file"  # file | etcd
    etcd_endpoint: str = "127.0.0.1:2379"
