"""Hydra composition: groups, presets, typos, types, the engine/backend rule, model dirs."""

from __future__ import annotations

import json

import pytest

from areal_cli.plan.compose import compose_dictconfig, group_options, load_config
from areal_cli.config.schema import ExperimentConfig
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError


def err(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(load_config(list(overrides)))
    return info.value


def test_default_is_the_embedded_cpu_experiment():
    cfg = load_config([])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.model.path == "builtin:tiny" and cfg.algo.name == "grpo"
    assert cfg.allocation_mode.spec == "hf:d1+d1" and cfg.engine.name == "fsdp"
    assert validate(cfg).spec == "hf:d1+fsdp:d1"
    assert cfg.cluster.device == "cpu" and cfg.cluster.n_gpus_per_node == 2
    assert cfg.dataset.train_path == "builtin:arith"
    assert cfg.trainer.sft_warmup_steps > 0
    assert cfg.experiment_name == "cpu_default"


def test_groups_and_required_options_exist():
    opts = group_options()
    assert set(opts["algo"]) >= {"grpo", "ppo", "dapo", "drgrpo", "rloo", "reinforce_pp", "gspo", "sft"}
    assert set(opts["engine"]) == {"fsdp", "megatron", "archon", "deepspeed"}
    assert set(opts["workflow"]) >= {"rlvr", "multi_turn"}
    assert set(opts["launcher"]) >= {"local", "slurm", "skypilot"}
    assert set(opts["model"]) >= {"tiny", "qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b", "qwen2_5_32b",
                                  "qwen3_30b_a3b", "llama3_8b"}
    assert "local_cpu" in opts["allocation_mode"] and "cpu_default" in opts["experiment"]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo", "drgrpo", "rloo", "reinforce_pp", "gspo", "sft", "rm"])
def test_every_algo_preset_composes(algo):
    assert load_config([f"algo={algo}"]).algo.name == algo


def test_every_preset_of_every_group_composes():
    for group, options in group_options().items():
        for opt in options:
            load_config([f"{group}={opt}"])


def test_model_presets_carry_architecture_facts():
    m = load_config(["model=qwen3_30b_a3b"]).model
    assert (m.num_experts, m.num_experts_per_tok, m.num_hidden_layers, m.head_dim) == (128, 8, 48, 128)
    m = load_config(["model=llama3_8b"]).model
    assert (m.num_attention_heads, m.num_key_value_heads, m.vocab_size) == (32, 8, 128256)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.group_sze=3"], "rollout.group_sze: unknown config key 'group_sze' in 'rollout' — fix: did "
                              "you mean 'rollout.group_size'?"),
    (["algo.lr=1e-6"], "algo.lr: unknown config key 'lr' in 'algo' — fix: did you mean 'algo.optim.lr'?"),
    (["rollout.batch_size=4"], "rollout.batch_size: unknown config key 'batch_size' in 'rollout' — fix: did "
                               "you mean 'algo.batch_size'?"),
    (["algo=grop"], "algo: unknown algo option 'grop' — fix: did you mean 'grpo'? options: dapo, drgrpo, "
                    "grpo, gspo, ppo, reinforce_pp, rloo, rm, sft"),
    (["modle=tiny"], "modle: unknown config key 'modle' — fix: did you mean 'model'?"),
    (["rollout.group_size=abc"], "rollout.group_size: expected an integer, got 'abc' — fix: set "
                                 "rollout.group_size to an integer"),
    (["algo.optim.lr=fast"], "algo.optim.lr: expected a number, got 'fast' — fix: set algo.optim.lr to a "
                             "number"),
    (["rollout"], "rollout: override 'rollout' has no '=' — fix: write key=value, e.g. "
                  "rollout.group_size=8 or algo=grpo"),
    (["algo=grpo,dapo"], "algo: 'grpo,dapo' is a sweep (comma-separated values): one run takes one value "
                         "— fix: run the sweep with `areal sweep algo=grpo,dapo`, or pick one value"),
    (["algo=grpo", "algo.optim.lr=1e-4,3e-4"],
     "algo.optim.lr: '1e-4,3e-4' is a sweep (comma-separated values): one run takes one value — fix: run "
     "the sweep with `areal sweep algo=grpo algo.optim.lr=1e-4,3e-4`, or pick one value"),
    (["rollout.group_size.x=1"], "rollout.group_size.x: 'rollout.group_size' is a value (an integer), not a "
                                 "section — fix: set rollout.group_size=<value>"),
    (["engine=fsdp", "allocation_mode=sglang.d4+megatron.d2t2p2"],
     "engine: engine=fsdp disagrees with allocation_mode=sglang.d4+megatron.d2t2p2, which trains with "
     "megatron — fix: drop engine=fsdp (the spec decides), or drop 'megatron' from the spec so the engine "
     "supplies it"),
])
def test_override_errors_are_typed_with_did_you_mean(overrides, message):
    assert err(*overrides).one_line() == message


def test_type_errors_match_between_fast_path_and_hydra(monkeypatch):
    fast = err("rollout.group_size=abc").one_line()
    monkeypatch.setenv("AREAL_COMPOSE", "hydra")
    assert err("rollout.group_size=abc").one_line() == fast
    # a float where an int is required only Hydra/OmegaConf decides: still a typed error
    e = err("rollout.group_size=1.5")
    assert e.path == "rollout.group_size"


def test_spec_parse_error_keeps_raw_text_for_caret():
    e = err("allocation_mode=sglang:d4+fsdp:x4")
    assert e.path == "allocation_mode.spec" and e.text == "sglang:d4+fsdp:x4" and e.text[e.column] == "x"


def test_engine_follows_spec_when_not_chosen():
    cfg = load_config(["allocation_mode=sglang.d4+megatron.d2t2p2", "cluster.n_nodes=2",
                       "cluster.n_gpus_per_node=8"])
    # the megatron preset applied: its dtype is the global default (GPU presets such as the
    # gsm8k_qwen7b_megatron experiment set bfloat16), its own section is there
    assert cfg.engine.name == "megatron" and cfg.engine.dtype == "float32"
    assert cfg.engine.megatron.sequence_parallel and cfg.engine.megatron.use_distributed_optimizer


def test_engine_supplies_backend_when_spec_omits_it():
    cfg = load_config(["engine=megatron", "allocation_mode=sglang.d4+d2t2p2", "cluster=gpu_2x8"])
    plan = validate(cfg)
    assert plan.train.backend == "megatron" and plan.spec == "sglang:d4+megatron:d2t2p2"


def test_engine_name_override_also_counts_as_explicit():
    e = err("engine.name=archon", "allocation_mode=sglang:d4+fsdp:d4")
    assert e.path == "engine" and "engine=archon" in e.reason


def test_allocation_preset_and_quoted_spec():
    assert load_config(["allocation_mode=gpu8_sglang_fsdp"]).allocation_mode.spec == "sglang:d4+fsdp:d4"
    assert load_config(["allocation_mode='vllm:d4t2|fsdp:d8'"]).allocation_mode.spec == "vllm:d4t2|fsdp:d8"
    assert load_config(["allocation_mode.spec=hf:d1|fsdp:d1"]).allocation_mode.spec == "hf:d1|fsdp:d1"


def test_experiment_preset_overrides_groups_but_cli_wins():
    cfg = load_config(["experiment=gsm8k_qwen7b_megatron"])
    assert (cfg.model.name, cfg.engine.name, cfg.launcher.name, cfg.cluster.n_nodes) == \
        ("qwen2_5_7b", "megatron", "slurm", 2)
    assert cfg.allocation_mode.spec == "sglang:d8+megatron:d2t2p2" and cfg.algo.batch_size == 64
    cfg = load_config(["experiment=gsm8k_qwen7b_megatron", "model=llama3_8b", "launcher=local"])
    assert cfg.model.name == "llama3_8b" and cfg.launcher.name == "local"
    validate(load_config(["experiment=gsm8k_qwen7b_megatron"]))


def test_model_path_reads_local_config_json(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 12,
        "hidden_size": 1024, "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}))
    cfg = load_config([f"model.path={d}", "model.num_hidden_layers=6"])
    m = cfg.model
    assert (m.num_attention_heads, m.num_key_value_heads, m.hidden_size, m.vocab_size) == (16, 4, 1024, 32000)
    assert m.num_hidden_layers == 6  # explicit override wins over config.json
    assert m.tie_word_embeddings is False and m.name == "my-model"
    with pytest.raises(ConfigError) as info:
        validate(load_config([f"model.path={d}", "cluster.n_gpus_per_node=8",
                              "allocation_mode=hf:d1+archon:d1t8"]))
    assert "num_key_value_heads=4" in info.value.reason


def test_model_path_errors(tmp_path):
    assert err(f"model.path={tmp_path}/nope").path == "model.path"
    (tmp_path / "empty").mkdir()
    assert "no config.json" in err(f"model.path={tmp_path}/empty").reason
    assert "unknown built-in model" in err("model.path=builtin:huge").reason
    assert load_config(["model=qwen2_5_7b"]).model.path == "Qwen/Qwen2.5-7B-Instruct"  # hub id: preset facts


def test_real_tiny_model_dir(tiny_model_dir):
    m = load_config([f"model.path={tiny_model_dir}"]).model
    with open(f"{tiny_model_dir}/config.json") as f:
        hf = json.load(f)
    assert (m.num_hidden_layers, m.hidden_size, m.vocab_size) == \
        (hf["num_hidden_layers"], hf["hidden_size"], hf["vocab_size"])


def test_compose_dictconfig_for_cfg_job():
    from omegaconf import OmegaConf

    dc = compose_dictconfig(["rollout.group_size=6", "allocation_mode=sglang:d2+megatron:d2"])
    y = OmegaConf.to_yaml(dc)
    assert "group_size: 6" in y and "spec: sglang:d2+megatron:d2" in y and "name: megatron" in y
