"""The placement of a job, plain and JSON-serialisable: which inference servers run on which node with which
devices, and how many trainer ranks each node hosts (:class:`JobLayout`). The launchers flatten the validated
plan into one; every process of the job reads it back from the run dir."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ServerSpec:
    """One inference server = one data-parallel instance of the inference allocation."""

    index: int
    backend: str = "hf"  # hf | vllm | sglang
    tp: int = 1
    pp: int = 1
    node: int = 0
    devices: list[int] = field(default_factory=list)  # device ids on its node (GPU ids; CPU: slots)

    @property
    def name(self) -> str:
        return f"server{self.index}"


@dataclass
class TrainerSpec:
    """The trainer job: ``world_size`` ranks over ``nnodes`` nodes (torchrun/srun)."""

    backend: str = "fsdp"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 0  # experts' tensor-parallel size (0: tp); set by the hybrid MoE form
    nnodes: int = 1
    nproc_per_node: int = 1
    first_node: int = 0  # trainer nodes are first_node .. first_node + nnodes - 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def node_ranks(self) -> list[int]:
        return list(range(self.first_node, self.first_node + self.nnodes))

    def node_of(self, rank: int) -> int:
        """The node trainer rank ``rank`` runs on: every launcher fills a node's ``nproc_per_node`` ranks in
        order (torchrun's static ``--node-rank``, Ray's placement)."""
        return self.first_node + rank // max(1, self.nproc_per_node)


@dataclass
class JobLayout:
    """The placement of one experiment onto ``n_nodes`` nodes."""

    n_nodes: int = 1
    device: str = "cpu"
    servers: list[ServerSpec] = field(default_factory=list)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    colocated: bool = False  # inference and training share devices (``|`` in allocation_mode)

    def servers_on(self, node: int) -> list[ServerSpec]:
        return [s for s in self.servers if s.node == node]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "JobLayout":
        return JobLayout(
            n_nodes=int(d.get("n_nodes", 1)), device=str(d.get("device", "cpu")),
            servers=[ServerSpec(**s) for s in d.get("servers", [])],
            trainer=TrainerSpec(**d.get("trainer", {})), colocated=bool(d.get("colocated", False)),
        )

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict())

    @staticmethod
    def load(path: str | os.PathLike) -> "JobLayout":
        return JobLayout.from_dict(json.loads(Path(path).read_text()))


# The inference servers' api key, when a launcher binds them to a non-loopback address (launcher=ray): the
# hf server reads it from this variable, the trainer's inference client sends it.
SERVER_KEY_ENV = "AREAL_SERVER_API_KEY"
# The model dir a trainer rank loads, set by whoever fetched a hub model on the rank's node (the run dir's
# launch.json then names the hub id, which each node resolves into its own HF cache).
MODEL_PATH_ENV = "AREAL_MODEL_PATH"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, p)
