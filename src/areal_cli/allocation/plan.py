"""The validated plan: what runs where, with per-device batch and memory estimates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from areal_cli.allocation.autosize import AutoChoice
from areal_cli.allocation.estimate import InferenceMemory, TrainMemory
from areal_cli.api.io_struct import ParallelStrategy


@dataclass
class InferencePart:
    name: str
    backend: str
    dp: int
    tp: int
    pp: int
    ep: int
    n_devices: int
    placement: list[tuple[int, list[int]]]  # [(node_index, [local device indices])]
    memory: InferenceMemory | None = None

    @property
    def devices_per_instance(self) -> int:
        return self.tp * self.pp

    def to_dict(self) -> dict:
        d = asdict(self)
        d["placement"] = [{"node": n, "devices": devs} for n, devs in self.placement]
        return d


@dataclass
class MicroBatch:
    """Per data-parallel rank, per training step."""

    sequences: int  # samples this rank trains on per step
    max_seq_len: int  # prompt + generated tokens
    tokens_per_mb: int  # token budget of one micro-batch (engine.max_tokens_per_mb, capped)
    n_micro_batches: int  # per optimiser step (per minibatch)
    auto: bool = False  # tokens_per_mb was chosen by engine.max_tokens_per_mb=auto (allocation/autosize.py)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainPart:
    name: str
    backend: str
    parallel: ParallelStrategy
    n_devices: int
    placement: list[tuple[int, list[int]]]
    ffn: ParallelStrategy | None = None  # hybrid MoE: the expert-part strategy
    micro_batch: MicroBatch | None = None
    memory: TrainMemory | None = None
    # GB per device of (weights, gradients, optimizer states) of the engines living in the actor's process beside
    # it: a KL reference, a distillation teacher, a reward model, a critic (allocation/estimate.py:companion_states)
    companions: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # node-local groups (ParallelDims.node_local_groups) the engine's own order strides over nodes
    split_groups: list[str] = field(default_factory=list)

    @property
    def rank_order(self) -> str:
        """The order the backend's mesh builder really lays the ranks out in (fastest first)."""
        return self.parallel.dims(self.backend).rank_order

    @property
    def total_gb(self) -> float:
        """The actor's estimate plus its companions': what one device of this component must hold."""
        return (self.memory.total_gb if self.memory else 0.0) + sum(self.companions)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_gb"] = self.total_gb
        d["parallel"]["world_size"] = self.parallel.world_size
        d["rank_order"] = self.rank_order
        d["placement"] = [{"node": n, "devices": devs} for n, devs in self.placement]
        return d


@dataclass
class Plan:
    spec: str  # canonical spec text with the train backend filled in
    inferences: list[InferencePart]
    trains: list[TrainPart]
    colocated: bool
    n_nodes: int
    n_devices_per_node: int
    device: str
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was decided for the user, e.g. the chosen recipe
    auto: list[AutoChoice] = field(default_factory=list)  # the values `auto` resolved to

    @property
    def inference(self) -> InferencePart | None:
        """The rollout inference part (the only one, or the one named ``gen``/``rollout``)."""
        for p in self.inferences:
            if p.name in ("gen", "rollout"):
                return p
        return self.inferences[0] if self.inferences else None

    @property
    def train(self) -> TrainPart:
        """The policy trainer (the only one, or the one named ``actor``/``policy``)."""
        for p in self.trains:
            if p.name in ("actor", "policy"):
                return p
        return self.trains[0]

    @property
    def n_devices_used(self) -> int:
        seen: set[tuple[int, int]] = set()
        for p in [*self.inferences, *self.trains]:
            for node, devs in p.placement:
                seen.update((node, d) for d in devs)
        return len(seen)

    def to_dict(self) -> dict:
        return {
            "valid": True,
            "spec": self.spec,
            "colocated": self.colocated,
            "cluster": {"n_nodes": self.n_nodes, "n_devices_per_node": self.n_devices_per_node,
                        "device": self.device},
            "n_devices_used": self.n_devices_used,
            "inference": [p.to_dict() for p in self.inferences],
            "train": [p.to_dict() for p in self.trains],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "auto": {a.path: a.to_dict() for a in self.auto},
        }
