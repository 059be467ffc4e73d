"""The algo config: selector values are registry keys, presets load and validate, docs list them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import areal_cli
from areal_cli.config.algo import AlgoConfig
from areal_cli.algorithms.config_checks import validate_algo_config
from areal_cli.errors import ConfigError

PRESET_DIR = Path(areal_cli.__file__).parent / "conf" / "algo"
PRESETS = ["grpo", "ppo", "dapo", "drgrpo", "rloo", "reinforce_pp", "gspo", "sft", "rm"]
DOCS = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"


def load_preset(name: str) -> AlgoConfig:
    merged = OmegaConf.merge(OmegaConf.structured(AlgoConfig), OmegaConf.load(PRESET_DIR / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def test_every_registered_name_validates_and_resolves():
    """The validator's allowed values are the registries' names, and every built-in target imports
    and passes its registration checks (parameters are inputs, declarations match signatures)."""
    from areal_cli.algorithms.registry import REGISTRIES

    for key, registry in REGISTRIES.items():
        assert registry.names()
        for name in registry.names():
            assert callable(registry.get(name))
            critic = key == "adv_estimator" and registry.spec(name).needs_values
            validate_algo_config(AlgoConfig(**{key: name}, use_critic=critic))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_validates(name):
    cfg = load_preset(name)
    assert cfg.name == name
    validate_algo_config(cfg)


def test_preset_knobs_match_their_papers():
    g, dapo, gspo, dr = (load_preset(n) for n in ("grpo", "dapo", "gspo", "drgrpo"))
    assert (g.kl_coef, g.kl_estimator, g.kl_in_reward, g.loss_agg) == (0.04, "k3", False, "seq-mean-token-mean")
    assert (dapo.eps_clip, dapo.eps_clip_high, dapo.loss_agg, dapo.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert dapo.dynamic_sampling and dapo.overlong_buffer_ratio == 0.2
    assert (gspo.policy_loss, gspo.eps_clip, gspo.eps_clip_high) == ("gspo", 3e-4, 4e-4)
    assert (dr.std_level, dr.loss_agg) == ("none", "seq-mean-token-sum-norm")
    ppo = load_preset("ppo")
    assert ppo.use_critic and ppo.adv_estimator == "gae"


def test_docs_describe_every_preset_knob():
    text = DOCS.read_text()
    for name in PRESETS:
        assert f"`algo={name}`" in text, name
        section = text.split(f"`algo={name}`", 1)[1].split("\n## ", 1)[0]
        for key, value in yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text()).items():
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            assert f"`{key}={shown}`" in section, f"docs/algorithms.md: algo={name} misses {key}={shown}"


@pytest.mark.parametrize("overrides,path", [
    ({"adv_estimator": "ppo"}, "algo.adv_estimator"),
    ({"loss_agg": "mean"}, "algo.loss_agg"),
    ({"kl_estimator": "k4"}, "algo.kl_estimator"),
    ({"mean_level": "global"}, "algo.mean_level"),
    ({"c_clip": 1.0}, "algo.c_clip"),
    ({"eps_clip": 0.0}, "algo.eps_clip"),
    ({"adv_estimator": "gae"}, "algo.use_critic"),
    ({"use_critic": True}, "algo.adv_estimator"),
    ({"behav_imp_weight_mode": "clip"}, "algo.behav_imp_weight_mode"),
    ({"overlong_buffer_ratio": 1.5}, "algo.overlong_buffer_ratio"),
    ({"lam": 1.5}, "algo.lam"),
])
def test_validation_names_the_path(overrides, path):
    with pytest.raises(ConfigError) as ei:
        validate_algo_config(AlgoConfig(**overrides))
    assert ei.value.path == path and ei.value.hint
