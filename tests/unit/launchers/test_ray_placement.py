"""launcher=ray without a cluster: config, plan → placement groups, plan node → Ray node, shortfall lines.

The node dicts have the shape `ray.nodes()` returns; the multi-node runs are in
tests/integration/launchers/test_ray_launcher.py (`pytest -m ray`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from areal_cli.plan.compose import load_config as compose
from areal_cli.errors import LaunchError
from areal_cli.launchers.ray_placement import (
    NODE_ID_LABEL,
    assign_nodes,
    nodes_from_ray,
    placement_groups,
    plan_node_needs,
)
from areal_cli.trainer.build import layout_from_plan


def _layout(*overrides: str):
    return layout_from_plan(compose(["launcher=ray", *overrides]), None)


def _node(
    node_id: str, name: str, alive: bool = True, labels: dict | None = None, **resources: float
) -> dict:
    return {
        "NodeID": node_id,
        "NodeName": name,
        "Alive": alive,
        "NodeManagerAddress": "10.0.0.1",
        "Resources": {**resources, "memory": 1e9, f"node:10.0.0.{len(node_id)}": 1.0},
        "Labels": {NODE_ID_LABEL: node_id, **(labels or {})},
    }


def test_launcher_ray_config_and_registry():
    cfg = compose(["launcher=ray", "launcher.ray.address=10.0.0.1:6379", "+launcher.ray.node_labels.pool=rl"])
    assert cfg.launcher.name == "ray" and cfg.launcher.ray.address == "10.0.0.1:6379"
    assert dict(cfg.launcher.ray.node_labels) == {"pool": "rl"}
    from areal_cli.launchers.base import LAUNCHERS

    assert LAUNCHERS["ray"][0] == "areal_cli.launchers.ray:RayLauncher"


def test_two_node_default_plan_maps_server_and_trainer_to_distinct_nodes():
    layout = _layout("cluster.n_nodes=2", "cluster.n_gpus_per_node=1")
    groups = {g.name: g for g in placement_groups(layout)}
    assert groups["inference"].bundles == [{"CPU": 1.0}] and groups["inference"].plan_nodes == [0]
    assert groups["trainer"].bundles == [{"CPU": 1.0}] and groups["trainer"].plan_nodes == [1]
    assert groups["trainer"].strategy == groups["inference"].strategy == "STRICT_PACK"
    nodes = nodes_from_ray(
        [
            _node("bbbb", "node-b", CPU=1),
            _node("aaaa", "node-a", CPU=1),
            _node("dead", "node-c", alive=False, CPU=8),
        ]
    )
    assignment = assign_nodes(layout, nodes)
    assert assignment[0].node_id != assignment[1].node_id
    assert groups["inference"].selectors(assignment) == [{NODE_ID_LABEL: assignment[0].node_id}]
    assert groups["trainer"].selectors(assignment) == [{NODE_ID_LABEL: assignment[1].node_id}]
    assert "dead" not in {n.node_id for n in nodes}


def test_cuda_counts_gpus_tp_server_is_one_bundle_and_trainer_spans_nodes():
    layout = _layout(
        "cluster.device=cuda",
        "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=4",
        "allocation_mode=sglang:d1t2+fsdp:d4",
        "launcher.ray.cpus_per_gpu=2",
    )
    groups = {g.name: g for g in placement_groups(layout, cpus_per_gpu=2)}
    assert groups["inference"].bundles == [{"GPU": 2.0, "CPU": 4.0}]  # the whole TP group, one node
    t = groups["trainer"]
    assert len(t.bundles) == 4 and all(b == {"GPU": 1.0, "CPU": 2.0} for b in t.bundles)
    assert t.plan_nodes == [0, 0, 1, 1] and t.strategy == "PACK"  # 2 GPUs left on node 0, 2 on node 1
    assert plan_node_needs(layout, cpus_per_gpu=2) == {
        0: {"GPU": 4.0, "CPU": 8.0},
        1: {"GPU": 2.0, "CPU": 4.0},
    }
    # A CPU-only cluster with plenty of CPUs still cannot hold a GPU plan.
    cpu_only = nodes_from_ray([_node("a" * 8, "x", CPU=64), _node("b" * 8, "y", CPU=64)])
    with pytest.raises(LaunchError, match=r"has 0 GPU but the plan needs 6 GPU \(short by 6 GPU\)"):
        assign_nodes(layout, cpu_only, cpus_per_gpu=2)
    gpus = nodes_from_ray([_node("a" * 8, "x", CPU=16, GPU=4), _node("b" * 8, "y", CPU=16, GPU=4)])
    got = assign_nodes(layout, gpus, cpus_per_gpu=2)
    assert {n.key for n in got.values()} == {"x", "y"}


def test_shortfall_lines_name_what_is_missing():
    layout = _layout("cluster.n_nodes=2", "cluster.n_gpus_per_node=2", "allocation_mode=hf:d2+d2")
    two = nodes_from_ray([_node("a" * 8, "node-a", CPU=1), _node("b" * 8, "node-b", CPU=1)])
    with pytest.raises(LaunchError) as e:
        assign_nodes(layout, two, where="auto")
    msg = str(e.value)
    assert "\n" not in msg and "has 2 CPU but the plan needs 4 CPU (short by 2 CPU)" in msg
    assert "node-a: 1 CPU" in msg and "ray start --num-cpus" in msg
    # Enough CPUs in total, but one node too few.
    with pytest.raises(LaunchError, match=r"has 1 node\(s\) but the plan puts work on 2 nodes"):
        assign_nodes(layout, nodes_from_ray([_node("c" * 8, "big", CPU=8)]))
    # Enough in total and enough nodes, but no single node holds plan node 0's two devices
    # (the server and trainer rank 0; rank 1 is on plan node 1).
    one = _layout("cluster.n_nodes=2", "cluster.n_gpus_per_node=2", "allocation_mode=hf:d1+d2")
    assert plan_node_needs(one) == {0: {"CPU": 2.0}, 1: {"CPU": 1.0}}
    flat = nodes_from_ray(
        [_node("a" * 8, "n1", CPU=1), _node("b" * 8, "n2", CPU=1), _node("c" * 8, "n3", CPU=1)]
    )
    with pytest.raises(LaunchError, match="no free node for plan node 0, which needs 2 CPU on one node"):
        assign_nodes(one, flat)
    got = assign_nodes(
        one,
        nodes_from_ray(
            [_node("a" * 8, "n1", CPU=1), _node("c" * 8, "n3", CPU=3), _node("d" * 8, "n4", CPU=2)]
        ),
    )
    assert got[0].key == "n4" and got[1].key == "n1"  # best fit: the smallest node that holds each


def test_a_trainer_split_unevenly_across_nodes_is_refused():
    # 3 ranks: 1 beside the two servers on node 0, 2 on node 1; one rank count per node cannot say that.
    layout = _layout(
        "cluster.n_nodes=2", "cluster.n_gpus_per_node=3", "allocation_mode=hf:d2+d3", "algo.batch_size=9"
    )
    with pytest.raises(LaunchError, match="3 trainer ranks .* 2 nodes"):
        placement_groups(layout)


def test_node_labels_select_nodes_and_duplicate_names_get_ids():
    raw = [_node("a1" * 4, "gpu", labels={"pool": "rl"}, CPU=2), _node("b2" * 4, "gpu", CPU=2)]
    assert [n.node_id for n in nodes_from_ray(raw, {"pool": "rl"})] == ["a1" * 4]
    both = nodes_from_ray(raw)
    assert len({n.key for n in both}) == 2 and all(n.key.startswith("gpu-") for n in both)


def test_dry_run_prints_placement_groups_without_ray():
    code = (
        "import sys, json; from areal_cli.cli.main import main\n"
        "try:\n"
        "    main(['train', 'launcher=ray', 'cluster.n_nodes=2', 'cluster.n_gpus_per_node=1', '--dry-run'])\n"
        "except SystemExit: pass\n"
        "print('RAY_IMPORTED' if 'ray' in sys.modules else 'NO_RAY', file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    groups = json.loads(r.stdout)["placement_groups"]
    assert [g["name"] for g in groups] == ["inference", "trainer"]
    assert [g["plan_nodes"] for g in groups] == [[0], [1]]
    assert "NO_RAY" in r.stderr, r.stderr[-2000:]
