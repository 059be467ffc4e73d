"""Plan → Ray cluster: which Ray node hosts each plan node, and the placement groups that pin every
process there. Pure functions over plain data (the dicts ``ray.nodes()`` returns), so the mapping is
tested without a cluster and ``areal train launcher=ray --dry-run`` needs no Ray.

- A device is a GPU on CUDA plans and a logical CPU on CPU plans (there a "device" is a process slot,
  as everywhere in the plan); CUDA bundles also reserve ``launcher.ray.cpus_per_gpu`` CPUs per GPU.
- Each plan node with work on it is matched to its own alive Ray node that can hold all of it
  (largest plan node first, best fit). The placement groups carry a per-bundle label selector on
  ``ray.io/node-id``, so every bundle lands on the Ray node its plan node was matched to.
- One placement group per component: the trainer gets one bundle per device (one rank each); the
  inference component one bundle per server, holding that server's t×p devices, because one actor
  runs a server and Ray schedules an actor into one bundle — which also keeps each TP/PP group on one
  node. A group whose bundles all sit on one plan node is STRICT_PACK.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from areal_cli.errors import LaunchError
from areal_cli.job.layout import JobLayout

NODE_ID_LABEL = "ray.io/node-id"


@dataclass
class RayNode:
    node_id: str
    name: str  # `ray start --node-name` (Ray's default: the node's IP)
    ip: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)
    key: str = ""  # unique short name used in messages and probe file names

    @property
    def label(self) -> str:
        return f"{self.key} (ip {self.ip}, ray node {self.node_id[:8]})"

    def has(self, res: str) -> float:
        return float(self.resources.get(res, 0.0))


def nodes_from_ray(raw: list[dict[str, Any]], required_labels: dict[str, str] | None = None) -> list[RayNode]:
    """The alive nodes of ``ray.nodes()`` carrying ``required_labels``, in a stable order."""
    want = {str(k): str(v) for k, v in (required_labels or {}).items()}
    out = []
    for n in raw:
        if not n.get("Alive", n.get("alive", False)):
            continue
        labels = {str(k): str(v) for k, v in (n.get("Labels") or {}).items()}
        if any(labels.get(k) != v for k, v in want.items()):
            continue
        ip = str(n.get("NodeManagerAddress", ""))
        out.append(
            RayNode(
                node_id=str(n["NodeID"]),
                name=str(n.get("NodeName") or ip),
                ip=ip,
                resources={k: float(v) for k, v in (n.get("Resources") or {}).items()},
                labels=labels,
            )
        )
    out.sort(key=lambda x: (x.name, x.node_id))
    names = [x.name for x in out]
    for x in out:
        x.key = x.name if names.count(x.name) == 1 else f"{x.name}-{x.node_id[:8]}"
    return out


def device_resource(device: str) -> str:
    return "GPU" if device == "cuda" else "CPU"


def bundle_resources(device: str, n_devices: int, cpus_per_gpu: float) -> dict[str, float]:
    if device == "cuda":
        out = {"GPU": float(n_devices)}
        if cpus_per_gpu > 0:
            out["CPU"] = float(n_devices) * float(cpus_per_gpu)
        return out
    return {"CPU": float(n_devices)}


@dataclass
class GroupSpec:
    """One placement group: a bundle per device (trainer) or per server (inference)."""

    name: str  # "inference" | "trainer"
    bundles: list[dict[str, float]]
    plan_nodes: list[int]  # the plan node of each bundle

    @property
    def strategy(self) -> str:
        # Bundles are pinned to nodes by label selectors; STRICT_PACK also says so to Ray when
        # the whole component is on one node.
        return "STRICT_PACK" if len(set(self.plan_nodes)) == 1 else "PACK"

    def selectors(self, assignment: dict[int, RayNode]) -> list[dict[str, str]]:
        return [{NODE_ID_LABEL: assignment[n].node_id} for n in self.plan_nodes]

    def to_dict(self, assignment: dict[int, RayNode] | None = None) -> dict[str, Any]:
        d = asdict(self)
        d["strategy"] = self.strategy
        if assignment is not None:
            d["ray_nodes"] = [assignment[n].label for n in self.plan_nodes]
        return d


def trainer_rank_node(layout: JobLayout, rank: int) -> int:
    return layout.trainer.node_of(rank)


def placement_groups(layout: JobLayout, cpus_per_gpu: float = 1.0) -> list[GroupSpec]:
    groups = []
    if layout.servers:
        groups.append(
            GroupSpec(
                "inference",
                [bundle_resources(layout.device, s.tp * s.pp, cpus_per_gpu) for s in layout.servers],
                [s.node for s in layout.servers],
            )
        )
    t = layout.trainer
    world = t.world_size
    if world != t.nnodes * t.nproc_per_node:
        raise LaunchError(
            f"launcher=ray: the plan splits {world} trainer ranks unevenly over {t.nnodes} nodes "
            f"(at most {t.nproc_per_node} per node) — fix: order or size allocation_mode so the "
            "train component fills whole nodes or fits on one"
        )
    groups.append(
        GroupSpec(
            "trainer",
            [bundle_resources(layout.device, 1, cpus_per_gpu) for _ in range(world)],
            [trainer_rank_node(layout, r) for r in range(world)],
        )
    )
    return groups


def plan_node_needs(layout: JobLayout, cpus_per_gpu: float = 1.0) -> dict[int, dict[str, float]]:
    """What each plan node with work on it reserves, summed over the bundles placed there."""
    needs: dict[int, dict[str, float]] = {}
    for g in placement_groups(layout, cpus_per_gpu):
        for node, b in zip(g.plan_nodes, g.bundles):
            acc = needs.setdefault(node, {})
            for k, v in b.items():
                acc[k] = acc.get(k, 0.0) + v
    return dict(sorted(needs.items()))


def _fmt(res: dict[str, float]) -> str:
    return " + ".join(f"{_num(v)} {k}" for k, v in sorted(res.items()))


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _fix(device: str) -> str:
    if device == "cuda":
        return (
            "— fix: add GPU nodes to the Ray cluster, or shrink allocation_mode / cluster.n_gpus_per_node "
            "(launcher.ray.cpus_per_gpu sets the CPUs reserved per GPU)"
        )
    return (
        "— fix: give the Ray nodes more logical CPUs (`ray start --num-cpus N`), add nodes, or shrink "
        "allocation_mode / cluster.n_gpus_per_node (on CPU a device is one CPU)"
    )


def assign_nodes(
    layout: JobLayout, nodes: list[RayNode], *, cpus_per_gpu: float = 1.0, where: str = "auto"
) -> dict[int, RayNode]:
    """Plan node → Ray node, or one :class:`LaunchError` line naming the shortfall."""
    needs = plan_node_needs(layout, cpus_per_gpu)
    have_txt = (
        ", ".join(
            f"{n.key}: {_fmt({k: n.has(k) for k in ('CPU', 'GPU') if n.has(k)}) or 'nothing'}" for n in nodes
        )
        or "no alive node"
    )
    intro = f"launcher=ray: the Ray cluster at launcher.ray.address={where} ({have_txt})"
    for res in sorted({k for nd in needs.values() for k in nd}):
        need = sum(nd.get(res, 0.0) for nd in needs.values())
        have = sum(n.has(res) for n in nodes)
        if need > have:
            raise LaunchError(
                f"{intro} has {_num(have)} {res} but the plan needs {_num(need)} {res} "
                f"(short by {_num(need - have)} {res}) {_fix(layout.device)}"
            )
    if len(needs) > len(nodes):
        raise LaunchError(
            f"{intro} has {len(nodes)} node(s) but the plan puts work on {len(needs)} nodes "
            f"(cluster.n_nodes={layout.n_nodes}) — fix: add Ray nodes or lower cluster.n_nodes"
        )
    out: dict[int, RayNode] = {}
    unit = device_resource(layout.device)
    for node, need in sorted(needs.items(), key=lambda kv: (-kv[1].get(unit, 0.0), kv[0])):
        fits = [n for n in nodes if n not in out.values() and all(n.has(k) >= v for k, v in need.items())]
        if not fits:
            raise LaunchError(
                f"{intro} has no free node for plan node {node}, which needs {_fmt(need)} on one "
                f"node {_fix(layout.device)}"
            )
        out[node] = min(fits, key=lambda n: (n.has(unit), nodes.index(n)))  # best fit, then stable
    return dict(sorted(out.items()))


def describe_assignment(layout: JobLayout, assignment: dict[int, RayNode], cpus_per_gpu: float = 1.0) -> str:
    needs = plan_node_needs(layout, cpus_per_gpu)
    return "; ".join(f"plan node{p} ({_fmt(needs[p])}) → {n.label}" for p, n in assignment.items())
