"""Place allocation components onto cluster nodes and devices.

Devices are numbered globally ``node * n_per_node + local``. Components are placed in spec order,
each '+' group on fresh devices, each '|'-colocated group on one shared device range; rank ``r`` of a
component runs on device ``start + r``. Inference instances (t·p devices) are contiguous. A training
component's ranks follow its engine's real order (:class:`~areal_cli.api.parallel_dims.ParallelDims`),
and the groups that exchange data every layer (``ParallelDims.node_local_groups``: the TP group, the
expert group, Ulysses, megatron's model-parallel group) must each fit in a node and sit on one. A
component starts at the next free device, or at the next node boundary when that is what keeps those
groups inside one node. The one exception is a group the engine's order itself strides wider than a
node (megatron's pp-last order with experts and stages: a replica's stages are d ranks apart); it
cannot share a node whatever the start, so placement reports it in ``Placement.split`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from areal_cli.allocation.parser import SPEC_PATH
from areal_cli.allocation.spec import AllocationSpec, Component
from areal_cli.api.parallel_dims import DIM_LETTER, ParallelDims
from areal_cli.errors import ConfigError

GROUP_WORDS = {"tp": "tensor", "cp": "context", "pp": "pipeline", "ep": "expert", "etp": "expert-tensor",
               "dp": "data", "edp": "expert-data"}


@dataclass
class Placement:
    """Devices of one component: ``[(node_index, [local device indices])]`` plus global ids."""

    devices: list[int]
    n_per_node: int
    split: list[str] = field(default_factory=list)  # node-local group tokens the engine's order strides apart

    @property
    def by_node(self) -> list[tuple[int, list[int]]]:
        out: dict[int, list[int]] = {}
        for g in self.devices:
            out.setdefault(g // self.n_per_node, []).append(g % self.n_per_node)
        return sorted(out.items())

    def text(self) -> str:
        parts = []
        for node, devs in self.by_node:
            parts.append(f"node{node}[{_ranges(devs)}]")
        return " ".join(parts)


def _ranges(devs: list[int]) -> str:
    out, start, prev = [], devs[0], devs[0]
    for d in devs[1:] + [None]:  # type: ignore[list-item]
        if d is not None and d == prev + 1:
            prev = d
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if d is not None:
            start = prev = d
    return ",".join(out)


def train_dims(c: Component, engine: str | None = None) -> ParallelDims:
    """A training component's sizes with its backend's rank order (``engine`` when the spec names none)."""
    return c.parallel().dims(c.backend or engine)


@dataclass
class NodeGroups:
    """The device groups of one component that must each sit on one node, as ``(first, last)`` rank
    pairs (every rank in between lies on the same node too), and the tokens that cannot."""

    spans: list[tuple[int, int]]
    split: list[str]


def _too_big(spec: AllocationSpec, c: Component, size: int, what: str, letters: list[str],
             n_per_node: int) -> ConfigError:
    dims = c.ffn if c.ffn is not None and "e" in letters else c.dims
    blame = next((x for x in ("p", "t", "c", "e") if x in letters and dims.span.get(x) is not None), "d")
    keep = "×".join(letters) or "t×p"
    return ConfigError(
        SPEC_PATH, f"'{c.label}' needs {size} devices per {what} group but a node has {n_per_node} "
        "(cluster.n_gpus_per_node)", f"keep {keep} within one node: lower {'/'.join(letters) or 't/p'} "
        "or use bigger nodes", text=spec.text, column=dims.span.get(blame, c.column))


def node_groups(spec: AllocationSpec, c: Component, n_per_node: int, engine: str | None = None) -> NodeGroups:
    """The groups of ``c`` placement keeps inside one node; a ConfigError when one is bigger than a node."""
    if c.kind == "inference":
        block = c.dims.t * c.dims.p  # one server instance
        if block > n_per_node:
            letters = [x for x in ("p", "t") if c.dims.get(x) > 1]
            raise _too_big(spec, c, block, "tensor/pipeline", letters, n_per_node)
        return NodeGroups([(k, k + block - 1) for k in range(0, c.world_size, block)], [])
    dims = train_dims(c, engine)
    spans: set[tuple[int, int]] = set()
    split = []
    for token in dims.node_local_groups:
        size = dims.group_size(token)
        if size == 1:
            continue
        names = [n for n in token.split("-") if dims.size(n) > 1]
        if size > n_per_node:
            raise _too_big(spec, c, size, "/".join(GROUP_WORDS[n] for n in names),
                           [DIM_LETTER[n] for n in names], n_per_node)
        mine = {(g[0], g[-1]) for g in dims.groups(token)}
        if max(b - a + 1 for a, b in mine) > n_per_node:
            split.append(token)  # strided by the engine's own order: no start keeps it on one node
        else:
            spans |= mine
    return NodeGroups(sorted(spans), split)


def _fits(start: int, spans: list[tuple[int, int]], n_per_node: int) -> bool:
    return all((start + a) // n_per_node == (start + b) // n_per_node for a, b in spans)


def place(spec: AllocationSpec, n_nodes: int, n_per_node: int, device: str = "cuda",
          engine: str | None = None, gpu_fix: Callable[[int], str] | None = None) -> list[Placement]:
    """Placement per component (same order as ``spec.components``) or a ConfigError. ``engine`` is the
    train backend of components the spec leaves unnamed. On ``device="cpu"`` a device is one process
    slot, so the fix offers more slots per node before more nodes, unless ``gpu_fix`` (devices needed ->
    the fix) says the spec is for GPUs anyway."""
    total = n_nodes * n_per_node
    need = sum(spec.components[g[0]].world_size for g in spec.groups)
    cluster_txt = (f"the cluster has {total} (cluster.n_nodes={n_nodes} × "
                   f"cluster.n_gpus_per_node={n_per_node})")
    if need > total:
        nodes_needed = -(-need // n_per_node)
        fix = (f"set cluster.n_gpus_per_node={need} (on CPU a device is a process slot), "
               f"cluster.n_nodes={nodes_needed}, or shrink the dims" if device == "cpu"
               else f"set cluster.n_nodes={nodes_needed} or shrink the dims")
        if device == "cpu" and gpu_fix is not None:
            fix = gpu_fix(need)
        raise ConfigError(SPEC_PATH, f"the spec needs {need} devices but {cluster_txt}", fix,
                          text=spec.text, column=spec.components[0].column)
    result: list[Placement | None] = [None] * len(spec.components)
    cursor = 0
    for group in spec.groups:
        members = [spec.components[i] for i in group]
        size = members[0].world_size
        local = {i: node_groups(spec, spec.components[i], n_per_node, engine) for i in group}
        candidates = [cursor]
        boundary = -(-cursor // n_per_node) * n_per_node
        if boundary != cursor:
            candidates.append(boundary)
        start = next((s for s in candidates if s + size <= total
                      and all(_fits(s, g.spans, n_per_node) for g in local.values())), None)
        if start is None:
            c = members[0]
            raise ConfigError(
                SPEC_PATH, f"cannot place '{c.label}' ({size} devices) after {cursor} used devices "
                f"without splitting a tensor/pipeline group across nodes; {cluster_txt}",
                f"add a node (cluster.n_nodes={n_nodes + 1}) or reorder/shrink the components",
                text=spec.text, column=c.column)
        for i in group:
            result[i] = Placement(list(range(start, start + size)), n_per_node, local[i].split)
        cursor = start + size
    return [p for p in result if p is not None]
