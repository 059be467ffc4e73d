"""Fuzzing: spec strings and override lists never produce a traceback.

Every input ends in either a valid Plan or a typed ConfigError that names a path, a reason and a
fix. ``test_fuzz_grammar`` runs ``AREAL_FUZZ_EXAMPLES`` (default 10,000) hypothesis examples in
process; each example is a hypothesis-drawn seed that drives a grammar-aware generator (fast:
hypothesis's own structured strategies cost ~5 ms per example to draw). The structured-strategy
tests below keep hypothesis's shrinking on smaller budgets, including inputs that only Hydra parses.
"""

from __future__ import annotations

import dataclasses
import os
import random
import typing

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_cli.plan.compose import group_options, load_config
from areal_cli.plan.fastcompose import _info
from areal_cli.config.paths import all_paths
from areal_cli.config.schema import ExperimentConfig
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError


def _settings(env: str, default: int) -> settings:
    return settings(max_examples=int(os.environ.get(env, str(default))), deadline=None, derandomize=True,
                    database=None, suppress_health_check=list(HealthCheck))


MODELS = ["tiny", "qwen2_5_0_5b", "qwen2_5_7b", "qwen3_30b_a3b", "llama3_8b", "qwen2_5_32b"]
_BASE = {m: load_config([f"model={m}"]) for m in MODELS}
_OPTS = group_options()
BACKENDS = ["sglang", "vllm", "hf", "fsdp", "megatron", "archon", "deepspeed"]
BAD_BACKENDS = ["sglng", "FSDP", "torch", "", "vlm"]
SIZES = ["1", "2", "4", "8", "1", "2", "3", "16", "0", "", "007", "99999999"]
WORDS = ["cpu", "cuda", "fsdp", "megatron", "local", "slurm", "disk", "distributed", "rlvr", "multi_turn",
         "grpo", "float32", "bfloat16", "none", "auto", "abc", "x.y.Z", "builtin:tiny", "builtin:arith",
         "'quoted value'", "least_loaded", "token-mean"]


# ------------------------------------------------------------------ grammar-aware generator
def gen_dims(r: random.Random, letters: str = "dtpce") -> str:
    out = []
    for letter in r.sample(letters, r.randint(0 if r.random() < 0.05 else 1, min(4, len(letters)))):
        if r.random() < 0.03:
            letter = r.choice("xyzDT")
        out.append(letter + r.choice(SIZES))
    if r.random() < 0.03:
        out.append(out[-1] if out else "d2")  # duplicate dim
    return "".join(out)


def gen_component(r: random.Random) -> str:
    roll = r.random()
    if roll < 0.08:
        return f"(attn:{gen_dims(r, 'dtpc')}|ffn:{gen_dims(r, 'dtpe')}{r.choice([')', ')', ''])}"
    backend = r.choice(BACKENDS) if r.random() > 0.06 else r.choice(BAD_BACKENDS)
    name = r.choice(["", "", "", "[gen]", "[actor]", "[critic]", "[ref]", "[]", "[a b]", "[x"])
    sep = r.choice([":", ".", ":", "", "::"]) if r.random() < 0.1 else r.choice([":", "."])
    if roll < 0.15 and backend == "megatron":
        return f"megatron{name}{sep}(attn:{gen_dims(r, 'dtpc')}|ffn:{gen_dims(r, 'dtpe')})"
    if roll < 0.25:
        return gen_dims(r)  # bare dims: engine supplies the backend
    return f"{backend}{name}{sep}{gen_dims(r)}"


def gen_spec(r: random.Random) -> str:
    if r.random() < 0.05:
        return "".join(r.choice("sglanvhfdmtrpce0123456789:.+|()[]_ ") for _ in range(r.randint(0, 20)))
    parts = [gen_component(r) for _ in range(r.randint(1, 4))]
    out = parts[0]
    for p in parts[1:]:
        out += r.choice(["+", "+", "|", "++", " + ", ","]) if r.random() < 0.1 else r.choice(["+", "|"])
        out += p
    return out


_LEAVES = [p for p in all_paths(ExperimentConfig)]


def _leaf_type(path: str):
    cls = ExperimentConfig
    parts = path.split(".")
    for part in parts[:-1]:
        cls = _info(cls)[part][1]
    declared, base, nested = _info(cls)[parts[-1]]
    return None if nested else declared


_TYPED = [(p, _leaf_type(p)) for p in _LEAVES if _leaf_type(p) is not None]
_SIMPLE = [(p, t) for p, t in _TYPED if typing.get_origin(t) not in (list, dict)
           and typing.get_origin(typing.Optional[int]) is not None]


def gen_value(r: random.Random, tp) -> str:
    args = set(typing.get_args(tp)) or {tp}
    if r.random() < 0.1 and args & {int, float} and bool not in args:
        return r.choice(["abc", "fast", "x1"])  # wrong for numbers: typed error
    if type(None) in args and r.random() < 0.2:
        return "null"
    if int in args and bool not in args:
        return str(r.choice([-1, 0, 1, 2, 3, 4, 8, 16, 64, 1000]))
    if float in args:
        return r.choice(["0.0", "1e-6", "0.5", "1", "2.5", "-1.0", "80"])
    if bool in args:
        return r.choice(["true", "false"])
    return r.choice(WORDS)


def gen_override(r: random.Random) -> str:
    roll = r.random()
    if roll < 0.3:
        g = r.choice(sorted(_OPTS))
        opt = r.choice(_OPTS[g]) if r.random() > 0.1 else r.choice(["nope", "grp", "a,b", ""])
        return f"{g}={opt}"
    if roll < 0.5:
        return f"allocation_mode={gen_spec(r)}"
    path, tp = r.choice(_SIMPLE)
    if r.random() < 0.08:
        path = path[:-1] + r.choice("xyz_") if r.random() < 0.5 else path.replace(".", "..", 1)
    return f"{path}={gen_value(r, tp)}"


def assert_typed(exc: ConfigError) -> None:
    assert exc.path and exc.reason and exc.hint, exc.one_line()
    if exc.column is not None:
        assert exc.text is not None and 0 <= exc.column <= len(exc.text), exc.one_line()


def check_plan(plan, n_nodes: int, per_node: int) -> None:
    for part in [*plan.inferences, *plan.trains]:
        devs = [(n, d) for n, ds in part.placement for d in ds]
        assert len(devs) == part.n_devices == len(set(devs))
        assert all(0 <= n < n_nodes and 0 <= d < per_node for n, d in devs)
    assert plan.n_devices_used <= n_nodes * per_node
    assert plan.to_dict()["valid"] is True


def run_spec(spec: str, model: str, engine: str, nodes: int, per_node: int, batch: int, algo: str):
    base = _BASE[model]
    cfg = dataclasses.replace(
        base, allocation_mode=dataclasses.replace(base.allocation_mode, spec=spec),
        engine=dataclasses.replace(base.engine, name=engine),
        cluster=dataclasses.replace(base.cluster, n_nodes=nodes, n_gpus_per_node=per_node),
        algo=dataclasses.replace(base.algo, batch_size=batch, name=algo))
    try:
        plan = validate(cfg)
    except ConfigError as exc:
        assert_typed(exc)
        return False
    check_plan(plan, nodes, per_node)
    return True


def run_overrides(overrides: list[str]) -> bool:
    try:
        plan = validate(load_config(overrides))
    except ConfigError as exc:
        assert exc.path and exc.reason, exc.one_line()
        return False
    assert plan.train.parallel.world_size >= 1
    return True


OUTCOMES = {"spec_ok": 0, "spec_err": 0, "ov_ok": 0, "ov_err": 0}


@_settings("AREAL_FUZZ_EXAMPLES", 10_000)
@given(st.integers(0, 2**63 - 1))
def test_fuzz_grammar(seed):
    r = random.Random(seed)
    ok = run_spec(gen_spec(r), r.choice(MODELS), r.choice(["fsdp", "megatron", "archon", "deepspeed"]),
                  r.randint(1, 4), r.choice([1, 2, 4, 8]), r.choice([1, 4, 8, 12, 64]),
                  r.choice(["grpo", "grpo", "sft"]))
    OUTCOMES["spec_ok" if ok else "spec_err"] += 1
    ok = run_overrides([gen_override(r) for _ in range(r.randint(0, 5))])
    OUTCOMES["ov_ok" if ok else "ov_err"] += 1


def test_fuzz_grammar_reaches_both_outcomes():
    # The generator is useful only if it produces valid plans as well as errors.
    r = random.Random(0)
    for _ in range(300):
        OUTCOMES["spec_ok" if run_spec(gen_spec(r), "qwen2_5_7b", "megatron", 4, 8, 64, "grpo")
                 else "spec_err"] += 1
        OUTCOMES["ov_ok" if run_overrides([gen_override(r) for _ in range(2)]) else "ov_err"] += 1
    assert all(v > 0 for v in OUTCOMES.values()), OUTCOMES


# ------------------------------------------------------------------ structured hypothesis strategies
dims_st = st.lists(st.tuples(st.sampled_from("dtpcex"), st.sampled_from(SIZES)), max_size=4).map(
    lambda xs: "".join(a + b for a, b in xs))
component_st = st.builds(lambda b, n, s, d: f"{b}{n}{s}{d}", st.sampled_from(BACKENDS + BAD_BACKENDS),
                         st.sampled_from(["", "[gen]", "[actor]", "[]"]), st.sampled_from([":", ".", ""]),
                         dims_st)
spec_st = st.one_of(
    st.lists(component_st, min_size=1, max_size=3).map("+".join),
    st.lists(component_st, min_size=1, max_size=3).map("|".join),
    st.text(alphabet="sglanvhfdmtrpce0123456789:.+|()[]_ ", max_size=30),
    st.text(max_size=12),
)


@_settings("AREAL_FUZZ_STRUCTURED_EXAMPLES", 300)
@given(spec=spec_st, model=st.sampled_from(MODELS), nodes=st.integers(1, 4),
       per_node=st.sampled_from([1, 2, 8]))
def test_fuzz_spec_structured(spec, model, nodes, per_node):
    run_spec(spec, model, "megatron", nodes, per_node, 64, "grpo")


# Inputs that only Hydra's own grammar decides (lists, +/~ prefixes, interpolations, odd quoting).
hydra_value_st = st.one_of(
    st.sampled_from(["[1,2]", "[a,b]", "{a: 1}", "${seed}", "'x'", "\"y\"", "1.5", "nan", "inf", "", " ",
                     "null", "a b", "1_000", "0x10", "'unterminated", "choice(1,2)", "${oops"]),
    st.text(alphabet="abc012[]{}$:,'\" .", max_size=10),
)
hydra_key_st = st.one_of(st.sampled_from(_LEAVES),
                         st.sampled_from(_LEAVES).map(lambda p: "+" + p),
                         st.sampled_from(_LEAVES).map(lambda p: "++" + p),
                         st.sampled_from(["launcher.trainer_env.X", "+launcher.trainer_env.X",
                                          "~rollout.queue_size", "workflow.kwargs.k"]))


@_settings("AREAL_FUZZ_HYDRA_EXAMPLES", 25)
@given(st.lists(st.builds(lambda k, v: f"{k}={v}", hydra_key_st, hydra_value_st), min_size=1, max_size=2))
def test_fuzz_hydra_only_inputs(overrides):
    run_overrides(overrides)
