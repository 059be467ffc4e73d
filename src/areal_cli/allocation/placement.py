"""Place allocation components onto cluster nodes and devices.

Devices are numbered globally ``node * n_per_node + local``. Components are placed in spec order,
each '+' group on fresh devices, each '|'-colocated group on one shared device range. Inside a
training component ranks are ordered tp → cp → pp → dp (tp fastest), so one model replica
(t·c·p devices) is contiguous; inference instances (t·p devices) are contiguous too. A component
starts at the next free device, or at the next node boundary when that is what keeps every
TP/PP group inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.allocation.parser import SPEC_PATH
from areal_cli.allocation.spec import AllocationSpec, Component
from areal_cli.errors import ConfigError


@dataclass
class Placement:
    """Devices of one component: ``[(node_index, [local device indices])]`` plus global ids."""

    devices: list[int]
    n_per_node: int

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


def group_block(c: Component) -> tuple[int, str]:
    """Devices that must share a node (one TP×PP group) and the letter to blame if too big."""
    d = c.dims
    if c.kind == "inference":
        block = d.t * d.p
    else:
        block = d.t * d.c * d.p
        if c.ffn is not None:
            block = max(block, c.ffn.t * c.ffn.p)  # expert-tensor × pipeline group
    letters = [x for x in ("p", "t", "c") if d.get(x) > 1 and d.span.get(x) is not None]
    return block, (letters[0] if letters else "d")


def _fits(start: int, size: int, block: int, n_per_node: int) -> bool:
    for k in range(0, size, block):
        first, last = start + k, start + k + block - 1
        if first // n_per_node != last // n_per_node:
            return False
    return True


def place(spec: AllocationSpec, n_nodes: int, n_per_node: int, device: str = "cuda") -> list[Placement]:
    """Placement per component (same order as ``spec.components``) or a ConfigError. On ``device="cpu"``
    a device is one process slot, so the fix offers more slots per node before more nodes."""
    total = n_nodes * n_per_node
    need = sum(spec.components[g[0]].world_size for g in spec.groups)
    cluster_txt = (f"the cluster has {total} (cluster.n_nodes={n_nodes} × "
                   f"cluster.n_gpus_per_node={n_per_node})")
    if need > total:
        nodes_needed = -(-need // n_per_node)
        fix = (f"set cluster.n_gpus_per_node={need} (on CPU a device is a process slot), "
               f"cluster.n_nodes={nodes_needed}, or shrink the dims" if device == "cpu"
               else f"set cluster.n_nodes={nodes_needed} or shrink the dims")
        raise ConfigError(SPEC_PATH, f"the spec needs {need} devices but {cluster_txt}", fix,
                          text=spec.text, column=spec.components[0].column)
    result: list[Placement | None] = [None] * len(spec.components)
    cursor = 0
    for group in spec.groups:
        members = [spec.components[i] for i in group]
        size = members[0].world_size
        blocks = []
        for c in members:
            block, letter = group_block(c)
            if block > n_per_node:
                col = c.dims.span.get(letter, c.column)
                raise ConfigError(
                    SPEC_PATH, f"'{c.label}' needs {block} devices per tensor/pipeline group but a node "
                    f"has {n_per_node} (cluster.n_gpus_per_node)",
                    "keep t×p (×c for training) within one node: lower t/p or use bigger nodes",
                    text=spec.text, column=col)
            blocks.append(block)
        candidates = [cursor]
        boundary = -(-cursor // n_per_node) * n_per_node
        if boundary != cursor:
            candidates.append(boundary)
        start = next((s for s in candidates if s + size <= total
                      and all(_fits(s, size, b, n_per_node) for b in blocks)), None)
        if start is None:
            c = members[0]
            raise ConfigError(
                SPEC_PATH, f"cannot place '{c.label}' ({size} devices) after {cursor} used devices "
                f"without splitting a tensor/pipeline group across nodes; {cluster_txt}",
                f"add a node (cluster.n_nodes={n_nodes + 1}) or reorder/shrink the components",
                text=spec.text, column=c.column)
        for i in group:
            result[i] = Placement(list(range(start, start + size)), n_per_node)
        cursor = start + size
    return [p for p in result if p is not None]
