"""The Hydra-free fast composer must produce exactly what Hydra's compose API produces."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_cli.plan.compose import CONF_DIR, group_options, load_config, prepare
from areal_cli.plan.fastcompose import fast_compose, parse_value
from areal_cli.errors import ConfigError


def via_hydra(overrides: list[str]):
    old = os.environ.get("AREAL_COMPOSE")
    os.environ["AREAL_COMPOSE"] = "hydra"
    try:
        return load_config(overrides)
    finally:
        if old is None:
            del os.environ["AREAL_COMPOSE"]
        else:
            os.environ["AREAL_COMPOSE"] = old


CASES = [
    [],
    ["algo=grpo", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2", "cluster.n_nodes=2",
     "cluster.n_gpus_per_node=8"],
    ["experiment=gsm8k_qwen7b_megatron"],
    ["experiment=gsm8k_qwen7b_megatron", "model=tiny", "launcher=local", "algo.optim.lr=1e-6"],
    ["model=qwen3_30b_a3b", "cluster=gpu_4x8", "allocation_mode=gpu32_moe_megatron"],
    ["rollout=sync", "workflow=multi_turn", "workflow.max_turns=3", "rollout.gconfig.top_p=0.9"],
    ["algo=dapo", "algo.eps_clip_high=0.28", "algo.c_clip=null", "resume=auto", "seed=7"],
    ["engine=deepspeed", "engine.deepspeed.zero_stage=2", "cluster.gpu_memory_gb=40", "trainer.total_epochs=3"],
    ["dataset.test_path='data/test.jsonl'", "dataset.system_prompt=\"Be brief.\"", "stats.wandb=true"],
    ["launcher=slurm", "launcher.slurm.partition=gpu", "launcher.slurm.time_min=30"],
    ["algo.temperature=0.7", "rollout.gconfig.temperature=0.7", "algo.kl_coef=0.001"],
]


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(c) or "<defaults>" for c in CASES])
def test_fast_path_equals_hydra(overrides):
    fast = fast_compose(prepare(overrides).hydra_overrides, CONF_DIR)
    assert fast is not None, "the fast path should handle this common case"
    assert fast == via_hydra(overrides)


def test_fast_path_defers_unusual_overrides_to_hydra():
    for ov in (["+launcher.trainer_env.FOO=1"], ["rollout.gconfig.stop=[a,b]"], ["seed=${trial_name}"]):
        assert fast_compose(prepare(ov).hydra_overrides, CONF_DIR) is None
    cfg = load_config(["rollout.gconfig.stop=[a,b]"])
    assert cfg.rollout.gconfig.stop == ["a", "b"]
    assert load_config(["+launcher.trainer_env.FOO=1"]).launcher.trainer_env == {"FOO": "1"}


@pytest.mark.parametrize("compose", ["fast", "hydra"])
def test_a_mapping_takes_new_keys_without_a_plus(compose, monkeypatch):
    """``launcher.trainer_env.K=V`` and ``launcher.trainer_env={K: V}`` add keys as ``+`` does: a mapping's
    keys are the user's, and Hydra's struct error ("Key 'K' is not in struct") would tell them nothing."""
    monkeypatch.setenv("AREAL_COMPOSE", compose)
    assert load_config(["launcher.trainer_env.FOO=1"]).launcher.trainer_env == {"FOO": "1"}
    cfg = load_config(["launcher.trainer_env={A: '2', B: x}", "launcher.server_env.C=3"])
    assert cfg.launcher.trainer_env == {"A": "2", "B": "x"} and cfg.launcher.server_env == {"C": "3"}
    assert load_config(["launcher.trainer_env.FOO=1", "launcher.trainer_env.FOO=2"]).launcher.trainer_env == {"FOO": "2"}


def test_parse_value_matches_hydra_grammar():
    assert parse_value("1") == 1 and parse_value("-3") == -3 and parse_value("1e-6") == 1e-6
    assert parse_value("1.5") == 1.5 and parse_value("true") is True and parse_value("NULL") is None
    assert parse_value("abc") == "abc" and parse_value("'a b'") == "a b" and parse_value("a/b:c") == "a/b:c"


_opts = group_options()
_values = {
    "rollout.group_size": st.integers(1, 16).map(str),
    "algo.batch_size": st.sampled_from(["4", "8", "16"]),
    "algo.optim.lr": st.sampled_from(["1e-6", "3.0e-4", "0.001", "1"]),
    "rollout.max_head_offpolicyness": st.integers(0, 8).map(str),
    "engine.gradient_checkpointing": st.sampled_from(["true", "false", "True"]),
    "algo.eps_clip_high": st.sampled_from(["null", "0.28", "1"]),
    "experiment_name": st.sampled_from(["x", "'with space'", "a-b_c", "1", "true", "1.5"]),
    "cluster.gpu_memory_gb": st.sampled_from(["80", "40.5", "abc"]),
    "rollout.group_size ": st.just("x"),
}
override_st = st.one_of(
    st.sampled_from(sorted(_opts)).flatmap(lambda g: st.sampled_from(_opts[g]).map(lambda o: f"{g}={o}")),
    st.sampled_from(sorted(_values)).flatmap(lambda k: _values[k].map(lambda v: f"{k.strip()}={v}")),
)


@settings(max_examples=int(os.environ.get("AREAL_EQUIV_EXAMPLES", "8")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.lists(override_st, max_size=5))
def test_fast_path_equals_hydra_property(overrides):
    def outcome(fn):
        try:
            return ("ok", fn())
        except ConfigError as exc:
            return ("error", exc.path)

    fast = outcome(lambda: load_config(overrides))
    hydra = outcome(lambda: via_hydra(overrides))
    assert fast == hydra


# --- what falls back to Hydra, and what does not -------------------------------------------------

def _conf_copy(tmp_path):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    return conf


@pytest.mark.parametrize("overrides", [
    ["+launcher.trainer_env.FOO=1"],  # append
    ["~seed"],  # delete
    ["rollout.gconfig.stop=[a,b]"],  # a list value
    ["plugins=[my_plugin]"],  # a list value
    ["seed=${trial_name}"],  # an interpolation
    ["seed=inf"],  # a value Hydra converts its own way
    ["algo.no_such_key=1"],  # Hydra writes the error
    ["allocation_mode=a/b"],  # a group option with a path
])
def test_each_unusual_override_falls_back(overrides):
    assert fast_compose(overrides, CONF_DIR) is None


def test_a_missing_option_file_or_bad_yaml_falls_back(tmp_path):
    conf = _conf_copy(tmp_path)
    (conf / "experiment" / "names_missing.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: no_such_model_q\n")
    assert fast_compose(["experiment=names_missing"], conf) is None
    (conf / "algo" / "broken.yaml").write_text("lr: [1, 2\n")
    assert fast_compose(["algo=broken"], conf) is None
    (conf / "experiment" / "other_header.yaml").write_text("# @package algo\nlr: 1\n")
    assert fast_compose(["experiment=other_header"], conf) is None
    (conf / "model" / "nested_defaults.yaml").write_text("defaults:\n  - tiny\n")
    assert fast_compose(["model=nested_defaults"], conf) is None


def test_a_bug_in_the_fast_path_is_not_swallowed(monkeypatch):
    """A wrong type or a missing key inside the composer is a bug: it raises, it does not quietly
    take the Hydra path."""
    from areal_cli.plan import fastcompose

    def broken(*_a, **_k):
        raise KeyError("a bug")

    monkeypatch.setattr(fastcompose, "_convert", broken)
    with pytest.raises(KeyError, match="a bug"):
        fast_compose(["seed=3"], CONF_DIR)
    monkeypatch.setattr(fastcompose, "_convert", lambda *a, **k: (_ for _ in ()).throw(TypeError("bug")))
    with pytest.raises(TypeError):
        fast_compose(["seed=3"], CONF_DIR)


def test_a_cli_type_error_is_a_config_error_not_a_fallback():
    with pytest.raises(ConfigError) as ei:
        fast_compose(["seed=abc"], CONF_DIR)
    assert ei.value.path == "seed"


@pytest.mark.parametrize("experiment", group_options()["experiment"])
def test_rollout_sync_is_honoured_under_every_experiment(experiment):
    """A group chosen on the command line is not undone by the experiment: `rollout=sync` means k=0 (an
    experiment that set the staleness itself once turned it back into async RL without a word)."""
    for compose in (load_config, via_hydra):
        cfg = compose([f"experiment={experiment}", "rollout=sync"])
        assert cfg.rollout.max_head_offpolicyness == 0, (experiment, compose.__name__)
        # the GPU recipes (long decodes) choose rollout=generation_bound (k=2), the CPU ones keep k=1
        want = 2 if experiment in GENERATION_BOUND else 1
        assert compose([f"experiment={experiment}"]).rollout.max_head_offpolicyness == want, experiment


GENERATION_BOUND = {"dapo", "gsm8k_grpo_1node", "gsm8k_grpo_megatron_2node", "gsm8k_qwen7b_megatron", "lora_grpo",
                    "moe_qwen3_30b", "ppo_critic", "sft_then_rl", "vlm", "real_model", "reward_model_rl"}
