"""The Archon device mesh: one ``DeviceMesh`` over ``(pp, dp, cp, tp)`` and the groups cut from it.

The order comes from :class:`~areal_cli.api.parallel_dims.ParallelDims` (``"tp-cp-ep-dp-pp"``, fastest
first), the table the plan prints and placement reads. It follows torchtitan: ``tp`` innermost, so
tensor-parallel peers are neighbouring ranks (one node, the fastest links), then ``cp``, ``dp``, and
``pp`` outermost (pipeline stages exchange only activations, the least traffic). Every dim is kept,
even at size 1, so the engine never has to ask which dims exist.

Parameters are FSDP-sharded over the flattened ``dp×cp`` ranks: Ulysses ranks hold the same weights,
so sharding over them too saves memory for free (the same choice as the FSDP engine).

Expert parallelism (``ep``) adds no ranks: it borrows from ``dp×cp`` as in torchtitan. The flattened
``dp_cp`` mesh is unflattened into ``(efsdp, ep)``, ``ep`` innermost (neighbouring ranks exchange tokens):
experts are cut over ``ep`` and FSDP-sharded over ``efsdp = dp×cp / ep``; everything else stays
FSDP-sharded over ``dp_cp``. Both come from the one world mesh, so FSDP2 accepts the 2-D expert DTensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_cli.api.parallel_dims import ParallelDims
from areal_cli.errors import ConfigError


@dataclass(frozen=True)
class ArchonDims(ParallelDims):
    """:class:`ParallelDims` with archon's rank order, plus the checks only archon needs."""

    engine: str | None = "archon"

    @classmethod
    def from_strategy(cls, parallel: Any, engine: str | None = "archon") -> ArchonDims:
        return super().from_strategy(parallel, engine)  # type: ignore[return-value]

    @property
    def shape(self) -> tuple[int, ...]:
        """The world mesh's sizes, slowest dim first: ``(pp, dp, cp, tp)``."""
        return self.mesh_shape()[1]

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ConfigError("allocation_mode", f"archon p{self.pp}d{self.dp}c{self.cp}t{self.tp} needs "
                              f"{self.world_size} processes but the trainer has {world_size}",
                              "make p×d×c×t equal to the number of trainer processes")

    def check_model(self, hf_config: Any) -> None:
        """Refuse a layout the model cannot be cut into (heads over t, layers over p)."""
        heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        if self.tp > 1 and (heads % self.tp or kv % self.tp):
            raise ConfigError("allocation_mode", f"t{self.tp} must divide num_attention_heads={heads} and "
                              f"num_key_value_heads={kv}", "pick t that divides both head counts")
        if self.cp > 1 and (heads // self.tp) % self.cp:
            raise ConfigError("allocation_mode", f"c{self.cp} must divide the heads per tensor-parallel rank "
                              f"({heads}/t{self.tp})", "pick c that divides num_attention_heads / t")
        self.check_experts(hf_config)
        layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
        if self.pp > layers:
            raise ConfigError("allocation_mode", f"p{self.pp} exceeds num_hidden_layers={layers}",
                              "use at most one pipeline stage per layer")

    def check_experts(self, hf_config: Any) -> None:
        """``e`` needs an MoE model whose expert count it divides, and must divide ``d×c``."""
        if self.ep == 1:
            return
        experts = int(getattr(hf_config, "num_experts", 0) or 0)
        if experts <= 0:
            raise ConfigError("allocation_mode", f"e{self.ep} needs an MoE model, but model_type="
                              f"{getattr(hf_config, 'model_type', '?')!r} has no experts",
                              "drop e from the archon dims or pick an MoE model (e.g. model=tiny_moe)")
        if experts % self.ep:
            raise ConfigError("allocation_mode", f"e{self.ep} does not divide num_experts={experts}",
                              "pick e that divides the expert count")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError("allocation_mode", f"e{self.ep} must divide d×c={self.dp * self.cp} "
                              "(archon cuts the experts over data-parallel ranks)", "lower e or raise d")
        if self.tp > 1:
            raise ConfigError("allocation_mode",
                              f"archon runs expert parallelism without t, got t{self.tp}e{self.ep}",
                              "drop t (use d×e), or use engine=megatron for experts cut over t")

    def build(self, device_type: str) -> ArchonMesh:
        """Build the mesh (collective: every rank of the default group must call it)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.check_world(dist.get_world_size())
        names, sizes = self.mesh_shape()  # the dims' own rank order, the one the plan prints
        world = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        fsdp = world["dp", "cp"]._flatten("dp_cp")
        # Everything one data-parallel replica spans: the batch is broadcast from its head over this.
        replica = world["pp", "cp", "tp"]._flatten("pp_cp_tp")
        expert = None
        if self.ep > 1:
            expert = fsdp._unflatten(0, (self.dp * self.cp // self.ep, self.ep), ("efsdp", "ep"))
        return ArchonMesh(dims=self, world=world, fsdp_mesh=fsdp, replica_mesh=replica, expert_mesh=expert)


@dataclass
class ArchonMesh:
    """The world mesh, its 1-D sub-meshes and this rank's coordinates."""

    dims: ArchonDims
    world: Any  # DeviceMesh ("pp", "dp", "cp", "tp")
    fsdp_mesh: Any  # 1-D DeviceMesh over dp×cp ("dp_cp")
    replica_mesh: Any  # 1-D DeviceMesh over pp×cp×tp: one data-parallel replica
    expert_mesh: Any = None  # 2-D DeviceMesh ("efsdp", "ep") over dp×cp when ep > 1
    _coords: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._coords = {n: self.world.get_local_rank(n) for n in self.dims.mesh_shape()[0]}

    # ---- sub-meshes
    def mesh(self, name: str):
        """The 1-D sub-mesh of dim ``name`` (``pp``/``dp``/``cp``/``tp``/``dp_cp``/``pp_cp_tp``)."""
        if name == "dp_cp":
            return self.fsdp_mesh
        if name == "pp_cp_tp":
            return self.replica_mesh
        return self.world[name]

    @property
    def tp_mesh(self):
        return self.world["tp"]

    @property
    def pp_mesh(self):
        return self.world["pp"]

    @property
    def dp_mesh(self):
        return self.world["dp"]

    @property
    def cp_mesh(self):
        return self.world["cp"]

    @property
    def ep_mesh(self):
        """1-D mesh of the ranks that split the experts (None when ep is 1)."""
        return None if self.expert_mesh is None else self.expert_mesh["ep"]

    @property
    def efsdp_mesh(self):
        """1-D mesh over which the expert shards are FSDP-sharded once more (dp×cp / ep ranks)."""
        return None if self.expert_mesh is None else self.expert_mesh["efsdp"]

    # ---- groups
    def group(self, name: str):
        return self.mesh(name).get_group()

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def cp_group(self):
        return self.group("cp")

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def fsdp_group(self):
        return self.fsdp_mesh.get_group()

    @property
    def replica_group(self):
        return self.replica_mesh.get_group()

    # ---- coordinates
    @property
    def pp_rank(self) -> int:
        return self._coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self._coords["dp"]

    @property
    def cp_rank(self) -> int:
        return self._coords["cp"]

    @property
    def tp_rank(self) -> int:
        return self._coords["tp"]

    @property
    def is_dp_head(self) -> bool:
        """The one rank per data-parallel replica that holds the replica's batch (and runs rollout)."""
        return self.pp_rank == 0 and self.cp_rank == 0 and self.tp_rank == 0

    @property
    def dp_head_rank(self) -> int:
        """Global rank of this replica's head (the source of its batch broadcast)."""
        import torch.distributed as dist

        return dist.get_global_rank(self.replica_group, 0)

    @property
    def is_stage_head(self) -> bool:
        """One rank per pipeline stage (dp=cp=tp=0): the one that streams that stage's weights."""
        return self.dp_rank == 0 and self.cp_rank == 0 and self.tp_rank == 0

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group along ``name``."""
        return [int(r) for r in self.mesh(name).mesh.flatten().tolist()]
