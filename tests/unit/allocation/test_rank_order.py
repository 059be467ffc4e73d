"""The plan prints the rank order each engine really uses, and placement keeps that order's TP,
expert and model-parallel groups on one node."""

from __future__ import annotations

import json

import pytest

from areal_cli.allocation import parse_allocation
from areal_cli.allocation.placement import place, train_dims
from areal_cli.cli.main import main


def plan_json(capsys, *overrides: str) -> dict:
    capsys.readouterr()
    code = main(["validate-config", *overrides, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


@pytest.mark.parametrize("engine,spec,extra,order", [
    ("fsdp", "hf:d1+fsdp:d2c2", (), "cp-dp"),
    ("deepspeed", "hf:d1+deepspeed:d4", (), "cp-dp"),
    ("archon", "hf:d1+archon:d2t2p2", (), "tp-cp-ep-dp-pp"),
    ("megatron", "hf:d1+megatron:d2t2p2", (), "tp-cp-ep-pp-dp"),
    ("megatron", "hf:d1+megatron:d4e2", ("model=qwen3_30b_a3b",), "tp-cp-ep-pp-dp"),
    ("megatron", "hf:d1+megatron:d2p2e2", ("model=qwen3_30b_a3b",), "tp-cp-ep-dp-pp"),
])
def test_validate_config_prints_the_engines_rank_order(capsys, engine, spec, extra, order):
    # launcher=slurm: a plan for a cluster's nodes, so it validates where megatron-core or deepspeed is absent;
    # an explicit micro-batch budget: a 30B model on this CPU cluster is a layout check, which auto would refuse
    d = plan_json(capsys, f"engine={engine}", f"allocation_mode={spec}", "cluster.n_gpus_per_node=16",
                  "algo.batch_size=16", "launcher=slurm", "engine.max_tokens_per_mb=4096", *extra)
    (train,) = d["train"]
    assert train["backend"] == engine and train["rank_order"] == order
    assert train["split_groups"] == []


def test_a_split_model_parallel_group_is_reported(capsys):
    # megatron with e and p: mcore's pp-last order puts a replica's two stages d·t = 8 ranks apart, so
    # its tp-pp group spans the two 8-device nodes whatever the start; the plan says so.
    d = plan_json(capsys, "engine=megatron", "model=qwen3_30b_a3b", "allocation_mode=megatron:d4t2p2e2",
                  "algo=sft", "cluster=gpu_2x8")
    assert d["train"][0]["rank_order"] == "tp-cp-ep-dp-pp"
    assert d["train"][0]["split_groups"] == ["tp-pp"]
    assert any("tp-pp group" in w for w in d["warnings"])


def _node_sets(spec: str, n_nodes: int, per_node: int, token: str) -> list[set[int]]:
    """For the train component: the nodes each group along ``token`` lands on."""
    s = parse_allocation(spec)
    (i, c), = [(i, c) for i, c in enumerate(s.components) if c.kind == "train"]
    devices = place(s, n_nodes, per_node)[i].devices
    return [{devices[r] // per_node for r in g} for g in train_dims(c).groups(token)]


@pytest.mark.parametrize("spec,tokens", [
    ("megatron:d2t4p2", ("tp", "tp-pp")),
    ("hf:d4+megatron:d1t4p2", ("tp", "tp-pp")),
    ("megatron:d4t2p2e2", ("tp", "etp-ep")),  # pp-last: the tp-pp group is the one that may not
    ("archon:d4t2p2", ("tp",)),
    ("hf:d2+archon:d2t2p2", ("tp", "tp-cp")),
    ("hf:d4+archon:d8e4", ("ep",)),
    ("hf:d6+archon:d4c2e4", ("cp", "ep")),
    ("hf:d3+fsdp:d2c4", ("cp",)),
])
def test_groups_never_span_nodes(spec, tokens):
    for token in tokens:
        assert all(len(nodes) == 1 for nodes in _node_sets(spec, 2, 8, token)), token


def test_archon_stages_may_span_nodes_but_tp_may_not():
    # archon puts pp outermost (stages exchange only activations): p2 over 2 nodes is one stage per node
    assert all(nodes == {0, 1} for nodes in _node_sets("archon:d4t2p2", 2, 8, "pp"))
    s = parse_allocation("archon:d1t2p8")  # a megatron t2p8 replica would not fit a node; archon's may
    assert place(s, 2, 8)[0].split == []
    # tp pairs may start mid-node and the component may cross nodes between pairs, not inside one
    assert place(parse_allocation("hf:d4+archon:d4t2"), 2, 8)[1].devices == list(range(4, 12))
    assert place(parse_allocation("hf:d3+archon:d4t2"), 2, 8)[1].devices == list(range(8, 16))
