"""The Qwen2.5-VL presets: validate-config plans them and counts the vision tower in the memory estimate
(issue 39 item 1), while the FLOPs of a text token leave it out."""

from __future__ import annotations

import pytest

from areal_cli.allocation.estimate import ModelFacts
from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate

GPU = ["cluster=gpu_1x8", "allocation_mode=gpu8_sglang_fsdp"]


@pytest.mark.parametrize("preset, text_twin, vision, total", [
    # the published sizes: Qwen2.5-VL-7B 8.29B, -3B 3.75B; the tower by hand from vision_config
    ("qwen2_5_vl_7b", "qwen2_5_7b", 676_550_144, 8.29e9),
    ("qwen2_5_vl_3b", None, 668_684_288, 3.75e9),
])
def test_presets_count_the_vision_tower(preset, text_twin, vision, total):
    cfg = load_config([f"model={preset}", *GPU])
    facts = ModelFacts.from_config(cfg.model)
    assert facts.vision == vision
    assert facts.total_params() == pytest.approx(total, rel=0.005)
    assert facts.active_params() == facts.total_params() - vision
    plan = validate(cfg)
    assert any(w.startswith("model.vision:") and "docs/vision.md" in w for w in plan.warnings)
    if text_twin:  # same language model: the estimates differ by the tower alone
        twin = load_config([f"model={text_twin}", *GPU])
        tplan = validate(twin)
        assert ModelFacts.from_config(twin.model).total_params() == facts.total_params() - vision
        assert plan.inference.memory.weights_gb > tplan.inference.memory.weights_gb
        assert plan.train.memory.weights_gb > tplan.train.memory.weights_gb
        assert not any(w.startswith("model.vision:") for w in tplan.warnings)


def test_text_models_have_no_tower():
    cfg = load_config([])
    assert cfg.model.vision.depth == 0 and ModelFacts.from_config(cfg.model).vision == 0


@pytest.mark.parametrize("override, where", [
    ("model.vision.num_heads=0", "model.vision.num_heads"),
    ("model.vision.num_heads=7", "model.vision.num_heads"),
    ("model.vision.hidden_size=0", "model.vision.hidden_size"),
])
def test_an_unusable_tower_is_a_config_error(override, where):
    from areal_cli.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(load_config(["model=qwen2_5_vl_3b", *GPU, override]))
    assert str(e.value).startswith(where) and "\n" not in str(e.value)


def test_areal_train_refuses_a_vision_model_before_fetching_it(monkeypatch):
    from areal_cli.cli import launch
    from areal_cli.cli.common import compose_and_validate
    from areal_cli.errors import ConfigError

    def no_fetch(cfg):
        raise AssertionError("fetched a model that nothing can train")

    monkeypatch.setattr(launch, "fetch_hub_model", no_fetch)
    with pytest.raises(ConfigError, match="vision-language model.*docs/vision.md") as e:  # vllm carries no images
        compose_and_validate(["model=qwen2_5_vl_7b", "cluster=gpu_1x8", "allocation_mode=vllm:d4+fsdp:d4"],
                             fetch_model=True)
    assert str(e.value).startswith("model.vision") and "\n" not in str(e.value)
    cfg, _ = compose_and_validate(["model=qwen2_5_vl_7b", *GPU])  # validate-config and --dry-run still plan it
    assert cfg.model.vision.depth == 32
