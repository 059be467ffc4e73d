"""The Qwen2.5-VL and Qwen2-VL presets: validate-config plans them and counts the vision tower in the memory estimate
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
    # Qwen2-VL-7B: 8.29B published; its tower is LayerNorm blocks with a plain 1280->5120->1280 MLP
    ("qwen2_vl_7b", "qwen2_5_7b", 675_759_104, 8.29e9),
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


@pytest.mark.parametrize("preset", ["qwen2_vl_7b", "qwen2_5_vl_7b"])
def test_preset_counts_equal_transformers_model_built_from_the_same_config(preset):
    """The planner's count against the real one: transformers' own model class, built on the meta device
    (no memory, no weights) from the preset's facts under the checkpoint's config names."""
    torch = pytest.importorskip("torch")
    import transformers

    m = load_config([f"model={preset}", *GPU]).model
    v = m.vision
    text = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings)
    common = dict(depth=v.depth, num_heads=v.num_heads, patch_size=v.patch_size, in_channels=v.in_channels,
                  temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size)
    if v.family == "qwen2_vl":  # Qwen2-VL's names: embed_dim is the ViT width, hidden_size the merger's output
        vision = dict(common, embed_dim=v.hidden_size, mlp_ratio=v.intermediate_size // v.hidden_size,
                      hidden_size=v.out_hidden_size)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                         tie_word_embeddings=m.tie_word_embeddings)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(common, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                      out_hidden_size=v.out_hidden_size)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=m.tie_word_embeddings)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    with torch.device("meta"):
        model = cls(cfg)
    facts = ModelFacts.from_config(m)
    assert facts.vision == sum(p.numel() for p in model.model.visual.parameters())
    # the language model's estimate leaves out Qwen2's q/k/v biases (0.002% here), and only those
    qkv_biases = m.num_hidden_layers * (m.num_attention_heads + 2 * m.num_key_value_heads) * facts.head_dim
    assert sum(p.numel() for p in model.parameters()) - facts.total_params() == qkv_biases


def test_a_local_qwen2_vl_dir_is_read_with_its_own_vision_names(tmp_path):
    """A hub-shaped Qwen2-VL config.json (flat text facts; the vision_config's embed_dim, mlp_ratio, in_chans
    and hidden_size = the merger's output) gives the qwen2_vl_7b preset's facts."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "vocab_size": 152064, "tie_word_embeddings": False,
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                          "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2}}))
    local = load_config([f"model.path={tmp_path}", *GPU]).model
    preset = load_config(["model=qwen2_vl_7b", *GPU]).model
    assert local.vision == preset.vision and local.vision.family == "qwen2_vl"
    assert ModelFacts.from_config(local).total_params() == ModelFacts.from_config(preset).total_params()
    # (read with Qwen2.5-VL's names, its hidden_size 3584 would be taken for the ViT's width)
    assert ModelFacts.from_config(local).vision == 675_759_104


def test_text_models_have_no_tower():
    cfg = load_config([])
    assert cfg.model.vision.depth == 0 and ModelFacts.from_config(cfg.model).vision == 0


@pytest.mark.parametrize("override, where", [
    ("model.vision.num_heads=0", "model.vision.num_heads"),
    ("model.vision.num_heads=7", "model.vision.num_heads"),
    ("model.vision.hidden_size=0", "model.vision.hidden_size"),
    ("model.vision.family=qwen3_vl", "model.vision.family"),
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
    with pytest.raises(ConfigError, match="does not train vision-language models") as e:
        compose_and_validate(["model=qwen2_5_vl_7b", "cluster=gpu_1x8", "engine=megatron",
                              "allocation_mode=sglang:d4+megatron:d4"], fetch_model=True)
    assert str(e.value).startswith("engine.name") and "\n" not in str(e.value)
    cfg, _ = compose_and_validate(["model=qwen2_5_vl_7b", *GPU])  # validate-config and --dry-run still plan it
    assert cfg.model.vision.depth == 32
