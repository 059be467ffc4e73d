"""Placement onto multi-node clusters and the cross-group validation rules."""

from __future__ import annotations

import pytest

from areal_cli.allocation import parse_allocation
from areal_cli.allocation.placement import place
from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError


def nodes(spec: str, n_nodes: int, per_node: int) -> list[list[tuple[int, list[int]]]]:
    return [p.by_node for p in place(parse_allocation(spec), n_nodes, per_node)]


def test_user_example_two_nodes():
    got = nodes("sglang.d4+megatron.d2t2p2", 2, 8)
    assert got == [[(0, [0, 1, 2, 3])], [(0, [4, 5, 6, 7]), (1, [0, 1, 2, 3])]]


def test_component_moves_to_node_boundary_to_keep_tp_group_together():
    # the fsdp t4 group would straddle node 0/1 at offset 6; it must start on node 1.
    got = nodes("hf:d6+archon:d1t4", 2, 8)
    assert got == [[(0, [0, 1, 2, 3, 4, 5])], [(1, [0, 1, 2, 3])]]


def test_colocated_components_share_devices():
    got = nodes("vllm:d4t2|fsdp:d8", 1, 8)
    assert got[0] == got[1] == [(0, list(range(8)))]


def test_four_nodes_moe():
    got = nodes("sglang:d4t4+megatron:(attn:d2t4p2|ffn:d1t1p2e8)", 4, 8)
    assert got[0] == [(0, list(range(8))), (1, list(range(8)))]
    assert got[1] == [(2, list(range(8))), (3, list(range(8)))]


def test_three_components_across_nodes():
    got = nodes("sglang[gen]:d2t2+fsdp[actor]:d4+fsdp[critic]:d4", 3, 4)
    assert got == [[(0, [0, 1, 2, 3])], [(1, [0, 1, 2, 3])], [(2, [0, 1, 2, 3])]]


def test_pure_dp_may_span_nodes_unaligned():
    assert nodes("hf:d3+fsdp:d5", 2, 4) == [[(0, [0, 1, 2])], [(0, [3]), (1, [0, 1, 2, 3])]]


def test_too_many_devices():
    with pytest.raises(ConfigError) as info:
        place(parse_allocation("sglang:d8+fsdp:d12"), 2, 8)
    assert info.value.one_line() == (
        "allocation_mode.spec: the spec needs 20 devices but the cluster has 16 (cluster.n_nodes=2 × "
        "cluster.n_gpus_per_node=8) — fix: set cluster.n_nodes=3 or shrink the dims")


def test_tp_group_larger_than_node():
    with pytest.raises(ConfigError) as info:
        place(parse_allocation("sglang:d1t16+fsdp:d8"), 4, 8)
    err = info.value
    assert "needs 16 devices per tensor/pipeline group but a node has 8" in err.reason
    assert err.text[err.column] == "t"


def test_pp_group_must_fit_in_a_node():
    with pytest.raises(ConfigError) as info:
        place(parse_allocation("megatron:d1t2p8"), 4, 8)
    assert err_col_char(info.value) == "p"


def test_alignment_needs_an_extra_node():
    with pytest.raises(ConfigError) as info:
        place(parse_allocation("hf:d6+archon:d1t4"), 1, 8)
    assert "needs 10 devices" in info.value.reason
    # 8 devices suffice in total, but the t3 groups cannot start at device 2 or 4 without
    # straddling the 4-device nodes (or running off the end).
    with pytest.raises(ConfigError) as info:
        place(parse_allocation("hf:d2+archon:d2t3"), 2, 4)
    assert "without splitting a tensor/pipeline group" in info.value.reason


def err_col_char(err: ConfigError) -> str:
    return err.text[err.column]


# ---------------------------------------------------------------- validate(): model/engine rules
def cfg(*overrides: str):
    return load_config(list(overrides))


def plan_of(*overrides: str):
    return validate(cfg(*overrides))


def test_user_example_plan():
    p = plan_of("algo=grpo", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2",
                "cluster.n_nodes=2", "cluster.n_gpus_per_node=8")
    assert p.train.backend == "megatron"
    assert (p.train.parallel.dp, p.train.parallel.tp, p.train.parallel.pp) == (2, 2, 2)
    assert p.inference is not None and (p.inference.dp, p.inference.tp) == (4, 1)
    assert p.n_devices_used == 12 and not p.colocated
    d = p.to_dict()
    assert d["train"][0]["parallel"]["world_size"] == 8
    assert d["inference"][0]["placement"] == [{"node": 0, "devices": [0, 1, 2, 3]}]


def test_default_plan_is_the_cpu_default():
    p = plan_of()
    assert p.spec == "hf:d1+fsdp:d1" and p.device == "cpu"
    assert p.train.micro_batch is not None and p.train.micro_batch.sequences == 16 * 8  # cpu_default: 16 prompts x group 8
    assert p.warnings == []


@pytest.mark.parametrize("overrides,path,needle,caret", [
    (("model=qwen2_5_7b", "cluster=gpu_1x8", "allocation_mode=sglang:d4t3+fsdp:d4"),
     "allocation_mode.spec", "t=3 does not divide model.num_attention_heads=28", "t"),
    (("model=qwen2_5_7b", "cluster=gpu_2x8", "allocation_mode=sglang:d4+megatron:d1t8"),
     "allocation_mode.spec", "t=8 does not divide model.num_attention_heads=28", "t"),
    (("model=qwen2_5_1_5b", "cluster=gpu_1x8", "allocation_mode=sglang:d4+archon:d1t4"),
     "allocation_mode.spec", "t=4 does not divide model.num_key_value_heads=2", "t"),
    (("model=llama3_8b", "cluster=gpu_2x8", "allocation_mode=sglang:d4+megatron:d1p3"),
     "allocation_mode.spec", "p=3 does not divide model.num_hidden_layers=32", "p"),
    (("model=qwen3_30b_a3b", "cluster=gpu_2x8", "allocation_mode=sglang:d4+megatron:d6e3"),
     "allocation_mode.spec", "e=3 does not divide model.num_experts=128", "e"),
    (("model=qwen2_5_7b", "cluster=gpu_2x8", "allocation_mode=sglang:d4+megatron:d4e2"),
     "allocation_mode.spec", "e=2 needs an MoE model", "e"),
    (("model=qwen2_5_7b", "cluster=gpu_1x8", "allocation_mode=sglang:d4+fsdp:d1c3"),
     "allocation_mode.spec", "Ulysses c=3", "c"),
    (("model=qwen3_30b_a3b", "cluster=gpu_4x8", "allocation_mode=megatron:(attn:d2t2p2|ffn:d1p2e2)",
      "algo=sft"),
     "allocation_mode.spec", "hybrid MoE parts use different device counts: attn 8, ffn 4", None),
    (("model=qwen3_30b_a3b", "cluster=gpu_4x8", "allocation_mode=megatron:(attn:d4t2p2|ffn:d4p4e1)",
      "algo=sft"), "allocation_mode.spec", "hybrid MoE pipeline sizes differ", "p"),
    (("model=qwen2_5_7b", "cluster=gpu_4x8", "allocation_mode=megatron:(attn:d2t2|ffn:d1t2e2)",
      "algo=sft"), "allocation_mode.spec", "needs an MoE model", None),
    (("engine=fsdp", "cluster=gpu_2x8", "allocation_mode=sglang.d4+d2p2"),
     "allocation_mode.spec", "engine fsdp does not support pipeline parallelism (p2)", "p"),
    (("cluster=gpu_1x8", "allocation_mode=sglang:d2+fsdp:d3"),
     "algo.batch_size", "is not divisible by DP=3", None),
    (("allocation_mode=fsdp:d1",), "allocation_mode.spec", "no inference component", None),
    (("algo.temperature=0.5",), "algo.temperature", "differs from rollout.gconfig.temperature", None),
    (("engine.max_tokens_per_mb=16",), "engine.max_tokens_per_mb", "smaller than one sequence", None),
    (("cluster.device=gpu",), "cluster.device", "unknown value 'gpu'", None),
    (("rollout.group_size=0",), "rollout.group_size", "out of range: must be in [1, inf)", None),
    (("model.num_key_value_heads=3",), "model.num_key_value_heads", "does not divide", None),
    (("cluster=gpu_1x8", "allocation_mode=sglang:d4+megatron:d3e2", "model=qwen3_30b_a3b"),
     "allocation_mode.spec", "expert parallel e=2 must divide d×c=3", "e"),
])
def test_validation_rules(overrides, path, needle, caret):
    with pytest.raises(ConfigError) as info:
        plan_of(*overrides)
    err = info.value
    assert err.path == path, err.one_line()
    assert needle in err.reason, err.one_line()
    assert err.hint
    if caret is not None:
        assert err.text is not None and err.text[err.column] == caret


def test_kv_replication_allowed_for_inference_only():
    # Qwen2.5-7B: 28 heads, 4 kv heads. sglang t=... 28 % 28 == 0 and 28 % 4 == 0 → replicated KV ok.
    p = plan_of("model=qwen2_5_7b", "cluster=gpu_4x8", "allocation_mode=sglang:d1t4+archon:d4t2",
                "algo.batch_size=8")
    assert p.inference.tp == 4 and p.train.parallel.tp == 2
    with pytest.raises(ConfigError):
        plan_of("model=llama3_8b", "cluster=gpu_4x8", "allocation_mode=sglang:d1+megatron:d1t16")


def test_memory_estimates_and_warnings():
    # An explicit budget that does not fit is a warning; engine.max_tokens_per_mb=auto (the default) refuses
    # the same plan (tests/unit/allocation/test_autosize.py).
    p = plan_of("model=qwen2_5_32b", "cluster=gpu_1x8", "allocation_mode=sglang:d1t4+fsdp:d4",
                "algo.batch_size=8", "engine.dtype=bfloat16", "engine.max_tokens_per_mb=4096")
    t = p.train.memory
    # 32.8B params, bf16, FSDP over 4: weights ≈ 15 GB/device, Adam+master 12 B/param / 4 ≈ 92 GB.
    assert 14 < t.weights_gb < 20 and t.optim_gb > 80
    assert any("exceeds the device" in w for w in p.warnings)
    inf = p.inference.memory
    assert 14 < inf.weights_gb < 16.5  # 65.5 GB bf16 / t4
    small = plan_of("model=qwen2_5_0_5b", "cluster=gpu_1x8", "allocation_mode=sglang:d4+fsdp:d4",
                    "engine.dtype=bfloat16")
    assert small.train.memory.total_gb < 80 and not any("exceeds" in w for w in small.warnings)


def test_param_counts_match_published_sizes():
    from areal_cli.allocation.estimate import ModelFacts

    expected = {"qwen2_5_0_5b": 0.49e9, "qwen2_5_1_5b": 1.54e9, "qwen2_5_7b": 7.6e9,
                "qwen2_5_32b": 32.8e9, "qwen3_30b_a3b": 30.5e9, "llama3_8b": 8.0e9}
    for name, n in expected.items():
        got = ModelFacts.from_config(cfg(f"model={name}").model).total_params()
        assert abs(got - n) / n < 0.03, (name, got)


