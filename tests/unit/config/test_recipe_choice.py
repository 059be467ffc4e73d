"""Which recipe a run gets without a named experiment, the toy-values warning, and --config-dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.cli.common import compose_and_validate
from areal_cli.plan.compose import load_config, prepare
from areal_cli.plan.fastcompose import fast_compose
from areal_cli.plan.groups import CONFIG_DIR_ENV, add_config_dirs, group_options, search_path
from areal_cli.errors import ConfigError

FOOTGUN = ["model=qwen2_5_7b", "cluster=gpu_1x8", "allocation_mode=gpu8_sglang_fsdp"]


def _hydra(monkeypatch, overrides):
    monkeypatch.setenv("AREAL_COMPOSE", "hydra")
    try:
        return load_config(overrides)
    finally:
        monkeypatch.delenv("AREAL_COMPOSE")


def test_a_real_model_preset_gets_the_real_model_recipe(monkeypatch):
    cfg, plan = compose_and_validate(FOOTGUN)
    assert cfg.experiment_name == "qwen2_5_7b"
    assert cfg.engine.dtype == "bfloat16"
    assert cfg.rollout.gconfig.max_new_tokens == 1024
    assert cfg.trainer.sft_warmup_steps == 0
    assert cfg.algo.optim.lr == pytest.approx(1e-6)
    assert any("experiment=real_model" in n for n in plan.notes)
    assert not any("toy-sized" in w for w in plan.warnings)
    assert _hydra(monkeypatch, FOOTGUN) == load_config(FOOTGUN)  # the fast composer and Hydra agree


def test_the_toy_keeps_cpu_default_and_no_note():
    cfg, plan = compose_and_validate([])
    assert cfg.experiment_name == "cpu_default"
    assert cfg.trainer.sft_warmup_steps == 600 and cfg.engine.dtype == "float32"
    # no recipe note; only what the auto/null knobs chose (the micro-batch size, the decoupled objective)
    auto = ("engine.max_tokens_per_mb=auto chose", "algo.use_decoupled_loss=null chose true")
    assert [n for n in plan.notes if not n.startswith(auto)] == []
    assert cfg.algo.use_decoupled_loss is True  # the default is async (rollout.max_head_offpolicyness=1)
    assert cfg.rollout.max_head_offpolicyness == 1


@pytest.mark.parametrize("path,real", [("builtin:tiny", False), ("/models/Qwen2.5-7B-Instruct", True),
                                       ("Qwen/Qwen2.5-0.5B-Instruct", True)])
def test_a_model_path_decides_toy_or_real(path, real):
    prep = prepare([f"model.path={path}"])
    assert ("experiment=real_model" in prep.hydra_overrides) is real
    if real:
        assert "experiment_name=Qwen2.5-7B-Instruct" in prep.hydra_overrides or \
            "experiment_name=Qwen2.5-0.5B-Instruct" in prep.hydra_overrides


def test_a_named_experiment_or_name_is_kept():
    prep = prepare(["model=qwen2_5_7b", "experiment=cpu_default"])
    assert not any(o.startswith("experiment=real") for o in prep.hydra_overrides)
    prep = prepare(["model=qwen2_5_7b", "experiment_name=mine"])
    assert "experiment=real_model" in prep.hydra_overrides
    assert not any(o.startswith("experiment_name=qwen") for o in prep.hydra_overrides)


def test_toy_values_on_a_real_model_warn_in_one_line():
    _, plan = compose_and_validate(["experiment=cpu_default", *FOOTGUN])
    toy = [w for w in plan.warnings if "toy-sized" in w]
    assert len(toy) == 1 and "\n" not in toy[0]
    for key in ("experiment_name=cpu_default", "engine.dtype=float32", "rollout.gconfig.max_new_tokens=16",
                "trainer.sft_warmup_steps=600", "algo.optim.lr=0.0002"):
        assert key in toy[0]


def test_values_given_explicitly_are_the_users():
    _, plan = compose_and_validate(["experiment=cpu_default", *FOOTGUN, "engine.dtype=float32",
                                    "rollout.gconfig.max_new_tokens=16", "rollout.eval_gconfig.max_new_tokens=32",
                                    "trainer.sft_warmup_steps=600",
                                    "algo.optim.lr=2e-4", "experiment_name=cpu_default"])
    assert not any("toy-sized" in w for w in plan.warnings)
    # a toy model never warns, whatever its values
    _, plan = compose_and_validate(["experiment=cpu_default"])
    assert not any("toy-sized" in w for w in plan.warnings)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(sys, "path", list(sys.path))
    d = tmp_path / "myconf"
    (d / "experiment").mkdir(parents=True)
    (d / "model").mkdir()
    (d / "model" / "my_tiny.yaml").write_text(
        Path(search_path()[-1] / "model" / "tiny.yaml").read_text().replace("name: tiny", "name: my_tiny"))
    (d / "experiment" / "my_run.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: my_tiny\nexperiment_name: my_run\n"
        "algo:\n  batch_size: 4\nplugins: [my_reward_mod]\n")
    (d / "my_reward_mod.py").write_text("MARK = 1\n")
    return d


def test_config_dir_extends_the_groups(user_dir, monkeypatch):
    add_config_dirs([str(user_dir)])
    assert str(user_dir.resolve()) in os.environ["PYTHONPATH"].split(os.pathsep)
    opts = group_options()
    assert "my_run" in opts["experiment"] and "cpu_default" in opts["experiment"]
    assert "my_tiny" in opts["model"]
    cfg = load_config(["experiment=my_run"])
    assert (cfg.experiment_name, cfg.model.name, cfg.algo.batch_size) == ("my_run", "my_tiny", 4)
    assert cfg.plugins == ["my_reward_mod"]  # importable: the config dir is on sys.path
    assert fast_compose(prepare(["experiment=my_run"]).hydra_overrides, search_path()) == cfg
    assert _hydra(monkeypatch, ["experiment=my_run"]) == cfg


def test_config_dir_refuses_a_clash_and_a_flat_layout(user_dir, tmp_path):
    (user_dir / "model" / "tiny.yaml").write_text("name: x\n")
    add_config_dirs([str(user_dir)])
    with pytest.raises(ConfigError, match="reuses the option name model=tiny"):
        group_options()
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "my_run.yaml").write_text("# @package _global_\n")
    with pytest.raises(ConfigError, match="my_run.yaml lie at its top"):
        add_config_dirs([str(flat)])


def test_config_dir_on_the_command_line(user_dir, tmp_path):
    env = {**os.environ, "NO_COLOR": "1"}
    for leaked in (CONFIG_DIR_ENV, "AREAL_PLUGINS"):  # what in-process tests before this one exported
        env.pop(leaked, None)
    out = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "validate-config", "--json",
                          "--config-dir", str(user_dir), "experiment=my_run"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    bad = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "validate-config", "experiment=my_run"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and "unknown experiment option 'my_run'" in bad.stderr


def test_a_small_model_on_disk_is_still_the_toy(tiny_model_dir, tmp_path):
    """A saved tiny model keeps cpu_default; the same config.json scaled past 100M parameters is real."""
    import json
    import shutil

    assert "experiment=real_model" not in prepare([f"model.path={tiny_model_dir}"]).hydra_overrides
    big = tmp_path / "big"
    shutil.copytree(tiny_model_dir, big)
    cfg = json.loads((big / "config.json").read_text())
    cfg.update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, vocab_size=32000)
    (big / "config.json").write_text(json.dumps(cfg))
    assert "experiment=real_model" in prepare([f"model.path={big}"]).hydra_overrides
