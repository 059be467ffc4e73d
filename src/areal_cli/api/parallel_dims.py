"""One source of truth for a training job's parallel sizes and the order its ranks take.

:class:`ParallelDims` holds the sizes (``dp`` data, ``cp`` context, ``tp`` tensor, ``pp`` pipeline,
``ep`` expert, ``etp`` the experts' own tensor size) and, through ``engine``, the rank order that
engine's mesh builder really uses. The planner prints that order, placement keeps the groups it
yields on one node, and the mesh builders (``engines/parallelize.py``, ``engines/archon/mesh.py``,
megatron's ``_init_parallel_state``) read their layout from here, so the plan cannot drift from the
engines.

Order strings follow megatron-core's convention (``parallel_state.RankGenerator``): tokens joined by
``-``, the *first* token varies fastest, so with ``"tp-cp-pp-dp"`` global rank =
``tp + T·(cp + C·(pp + P·dp))``. Expert parallelism adds no ranks; as in mcore, one string serves two
views of the same ranks:

* the dense view drops ``ep`` (size 1): ``tp``, ``cp``, ``pp``, ``dp``;
* the expert view drops ``cp``, reads ``tp`` as ``etp`` and ``dp`` as ``edp`` = world / (etp·ep·pp).

So an ``ep`` placed right after ``cp`` means "experts are cut over the innermost ranks of dp×cp",
which is what both archon (torchtitan's unflatten of ``dp_cp`` into ``(efsdp, ep)``) and mcore's expert
rank generator do. Dims an engine's order does not name must be 1.

Torch-free on purpose: the CLI validates and plans without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_cli.errors import ConfigError

PATH = "allocation_mode.spec"
SIZE_FIELDS = ("dp", "cp", "tp", "pp", "ep")
DENSE_DIMS = ("tp", "cp", "pp", "dp")
EXPERT_DIMS = ("etp", "ep", "pp", "edp")
DIM_LETTER = {"dp": "d", "cp": "c", "tp": "t", "pp": "p", "ep": "e", "etp": "t", "edp": "d"}

# The one table of rank orders (fastest first). fsdp/deepspeed build a ("dp", "cp") DeviceMesh;
# archon a ("pp", "dp", "cp", "tp") one (torchtitan: tp innermost on the fastest links, pp outermost
# since stages exchange only activations) with experts carved innermost from dp×cp; megatron keeps a
# replica's tp·pp ranks contiguous (pp before dp) except in MEGATRON_PP_LAST's case.
RANK_ORDERS = {
    "fsdp": "cp-dp",
    "deepspeed": "cp-dp",
    "archon": "tp-cp-ep-dp-pp",
    "megatron": "tp-cp-ep-pp-dp",
}
# mcore 0.16.1 (initialize_model_parallel) accepts experts with stages only in a pp-last order, since
# the attention and expert layers then have different data-parallel sizes: a replica's stages are
# strided by d there.
MEGATRON_PP_LAST = "tp-cp-ep-dp-pp"
# Engines outside the table (plugins): the layout the plan has always assumed, tp fastest and a
# model replica (tp·cp·pp ranks) contiguous.
DEFAULT_RANK_ORDER = "tp-cp-ep-pp-dp"

# Groups that exchange data every layer and so belong on one node (the fastest links). Placement
# refuses a layout where one of them is larger than a node, and keeps each on one node unless the
# engine's own order strides it wider than a node (megatron's pp-last order: then it reports it).
NODE_LOCAL_GROUPS = {
    "fsdp": ("cp",),
    "deepspeed": ("cp",),
    "archon": ("tp-cp", "etp-ep"),
    "megatron": ("tp", "tp-pp", "etp-ep"),
}
DEFAULT_NODE_LOCAL_GROUPS = ("tp-cp-pp", "etp-ep")


def rank_order_for(engine: str | None, ep: int = 1, pp: int = 1) -> str:
    """The order ``engine`` lays its ranks out in (mcore's string convention, fastest first)."""
    if engine == "megatron" and ep > 1 and pp > 1:
        return MEGATRON_PP_LAST
    return RANK_ORDERS.get(engine or "", DEFAULT_RANK_ORDER)


@dataclass(frozen=True)
class ParallelDims:
    """Parallel sizes of one training job and, through ``engine``, its rank order.

    ``world_size`` = dp·cp·tp·pp (``ep`` borrows ranks, it adds none). ``etp`` None means the experts
    use ``tp``. ``engine`` None: the default order (tp fastest, a replica contiguous).
    """

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    engine: str | None = None

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS + ("etp",):
            v = getattr(self, name)
            if name == "etp" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                who = f"{self.engine} " if self.engine else ""
                raise ConfigError(PATH, f"{who}parallel size {name} must be a positive integer, got {v!r}",
                                  f"set {DIM_LETTER[name]}1 or larger")
        missing = [n for n in SIZE_FIELDS if getattr(self, n) > 1 and n not in self.rank_order.split("-")]
        if missing:
            sizes = ", ".join(f"{n}={getattr(self, n)}" for n in missing)
            raise ConfigError(PATH, f"engine {self.engine}'s rank order {self.rank_order} has no "
                              f"{'/'.join(missing)} dim, got {sizes}",
                              f"drop {''.join(DIM_LETTER[n] for n in missing)} from the {self.engine} dims")

    @classmethod
    def from_strategy(cls, parallel: Any, engine: str | None = None) -> ParallelDims:
        """From a :class:`~areal_cli.api.io_struct.ParallelStrategy` (``etp`` 0 there means ``tp``)."""
        etp = int(getattr(parallel, "etp", 0) or 0)
        return cls(dp=int(parallel.dp), cp=int(parallel.cp), tp=int(parallel.tp), pp=int(parallel.pp),
                   ep=int(getattr(parallel, "ep", 1) or 1), etp=etp or None, engine=engine)

    # ---- sizes
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers: world / (etp·ep·pp), as mcore computes it."""
        inner = self.expert_tp * self.ep * self.pp
        if self.world_size % inner:
            raise ConfigError(PATH, f"the experts' t{self.expert_tp} × e{self.ep} × p{self.pp} = {inner} "
                              f"does not divide the {self.world_size} ranks",
                              "make e × p (× the experts' t) divide d·c·t·p")
        return self.world_size // inner

    def size(self, dim: str) -> int:
        if dim == "etp":
            return self.expert_tp
        if dim == "edp":
            return self.expert_dp
        return getattr(self, dim)

    # ---- order
    @property
    def rank_order(self) -> str:
        """The engine's order, fastest-varying first (``"tp-cp-ep-pp-dp"``: tp fastest)."""
        return rank_order_for(self.engine, self.ep, self.pp)

    def view(self, expert: bool = False) -> tuple[tuple[str, int], ...]:
        """``(dim, size)`` fastest first: the dense view (tp, cp, pp, dp in the engine's order) or the
        expert view (etp, ep, pp, edp). Dims the order leaves out are size 1 and come last."""
        tokens = self.rank_order.split("-")
        if expert:
            rename = {"tp": "etp", "dp": "edp", "ep": "ep", "pp": "pp"}
            names = [rename[t] for t in tokens if t in rename]
            names += [n for n in EXPERT_DIMS if n not in names]
        else:
            names = [t for t in tokens if t != "ep"]
            names += [n for n in DENSE_DIMS if n not in names]
        return tuple((n, self.size(n)) for n in names)

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Dense dim names and sizes in DeviceMesh order (slowest first, the last dim fastest), only
        the dims the engine's order names: ``init_device_mesh(dev, sizes, mesh_dim_names=names)``."""
        named = [t for t in self.rank_order.split("-") if t != "ep"]
        return tuple(reversed(named)), tuple(self.size(n) for n in reversed(named))

    # ---- rank arithmetic
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dim, dense (tp, cp, pp, dp) and expert (etp, ep, edp)."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        for expert in (False, True):
            rest = rank
            for name, size in self.view(expert):
                out[name], rest = rest % size, rest // size
        return out

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """Global ranks of ``rank``'s group along ``dim``: one dim or several joined by ``-``
        (``"tp-pp"``, mcore's token syntax); expert dims (etp, ep, edp) may not mix with cp/tp/dp."""
        self._check_rank(rank)
        view = self._view_for(dim)
        wanted = set(dim.split("-"))
        strides, stride = [], 1
        for _, size in view:
            strides.append(stride)
            stride *= size
        base, free = 0, []
        rest = rank
        for (name, size), s in zip(view, strides):
            c, rest = rest % size, rest // size
            if name in wanted:
                free.append((size, s))
            else:
                base += c * s
        ranks = [base]
        for size, s in free:
            ranks = [r + k * s for k in range(size) for r in ranks]
        return sorted(ranks)

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each sorted, in order of its lowest rank (mcore's ``get_ranks``)."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            g = self.group_ranks(dim, r)
            seen.setdefault(g[0], g)
        return [seen[k] for k in sorted(seen)]

    @property
    def node_local_groups(self) -> tuple[str, ...]:
        """Group tokens that belong on one node for this engine (see NODE_LOCAL_GROUPS)."""
        return NODE_LOCAL_GROUPS.get(self.engine or "", DEFAULT_NODE_LOCAL_GROUPS)

    def group_size(self, dim: str) -> int:
        out = 1
        for name in dim.split("-"):
            out *= self.size(name)
        return out

    def _view_for(self, dim: str) -> tuple[tuple[str, int], ...]:
        names = dim.split("-")
        dense, expert = set(DENSE_DIMS), set(EXPERT_DIMS)
        if not names or any(n not in dense | expert for n in names):
            raise ValueError(f"unknown parallel dim {dim!r}: use tp, cp, pp, dp, etp, ep, edp joined by '-'")
        if all(n in dense for n in names):
            return self.view(expert=False)
        if all(n in expert for n in names):
            return self.view(expert=True)
        raise ValueError(f"{dim!r} mixes dense (tp, cp, dp) and expert (etp, ep, edp) dims")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
