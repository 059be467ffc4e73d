"""Image-bearing batches (``multi_modal``, api/engine_api.py): every helper that selects, splits, reorders or
concatenates rows keeps each row's images with its tokens; the VL names, LoRA placement and the validator's
refusals."""

from __future__ import annotations

import pytest
import torch

from areal_cli.engines import packing, vision

IMG = 50  # row r's first token is IMG + r; its images (if any) are tagged r


def _batch(B: int = 7) -> dict:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 12, (B,), generator=g)
    L = int(lens.max())
    am = torch.arange(L)[None] < lens[:, None]
    ids = torch.randint(1, IMG, (B, L), generator=g) * am
    ids[:, 0] = IMG + torch.arange(B)
    mm = [None if r % 3 == 1 else {"pixel_values": torch.full((4 * (r + 1), 6), float(r)),
                                   "image_grid_thw": torch.tensor([[1, 2, 2]] * (r + 1))} for r in range(B)]
    return {"input_ids": ids, "attention_mask": am, "loss_mask": am.float(), "rewards": torch.arange(B).float(),
            "group_id": torch.arange(B), "multi_modal": mm}


def _rows_kept(b: dict) -> None:
    assert len(b["multi_modal"]) == b["input_ids"].shape[0]
    for r, e in enumerate(b["multi_modal"]):
        src = int(b["input_ids"][r, 0]) - IMG
        assert int(b["rewards"][r]) == src
        if src % 3 == 1:
            assert e is None
        else:
            assert e is not None and torch.all(e["pixel_values"] == src) and e["image_grid_thw"].shape[0] == src + 1


def test_micro_batch_bins_and_dp_split_keep_images_with_rows():
    b = _batch()
    lens = packing.seq_lens(b)
    bins = packing.equalize_bins(packing.ffd_bins(lens, 14), lens, 5)
    assert len(bins) > 1
    for rows in bins:
        _rows_kept(packing.select_rows(b, rows))
    parts = packing.split_batch_for_dp(b, 3)
    assert sorted(int(x) for p in parts for x in p["rewards"]) == list(range(7))
    for p in parts:
        _rows_kept(p)


def test_minibatches_concat_and_episode_order_keep_images_with_rows():
    from areal_cli.algorithms.actor import split_minibatches
    from areal_cli.api.workflow_api import Trajectory
    from areal_cli.rollout.worker import canonical_order

    b = _batch()
    for mb in split_minibatches(b, 3):
        _rows_kept(mb)
    parts = [packing.select_rows(b, [4, 5, 6]), packing.select_rows(b, [0, 1]), packing.select_rows(b, [2, 3])]
    cat = Trajectory.concat([Trajectory(dict(p)) for p in parts]).data
    _rows_kept(cat)
    assert [int(x) for x in cat["rewards"]] == [4, 5, 6, 0, 1, 2, 3]
    ordered = canonical_order(b, [6, 5, 4, 3, 2, 1, 0])  # one row per episode, released in reverse
    _rows_kept(ordered)
    assert [int(x) for x in ordered["rewards"]] == [6, 5, 4, 3, 2, 1, 0]


def test_a_micro_batch_images_are_its_rows_in_row_order():
    b = packing.select_rows(_batch(), [5, 0, 2])
    pv, grid = vision.images(b)
    assert pv[:, 0].unique_consecutive().tolist() == [5.0, 0.0, 2.0]  # the micro-batch's rows, in its order
    assert grid.shape == (6 + 1 + 3, 3) and pv.shape[0] == 4 * (6 + 1 + 3)
    assert vision.images(packing.select_rows(_batch(), [1, 4])) is None
    bad = _batch()
    bad["multi_modal"][0] = {"pixel_values": torch.zeros(4, 6)}
    with pytest.raises(ValueError, match="image_grid_thw"):
        vision.images(bad)


def test_vl_names_follow_the_hub_checkpoint():
    assert vision.hub_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert vision.hub_name("model.language_model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert vision.hub_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert vision.hub_name("lm_head.weight") == "lm_head.weight"
    assert vision.hub_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_lora_on_a_vlm_wraps_the_language_model_only(family):
    import transformers

    from areal_cli.config.model import LoRAConfig
    from areal_cli.engines import lora
    from areal_cli.models.tiny_vl import FAMILIES, VISION_TOKENS, tiny_vl_config

    ids = {t: 60 + i for i, t in enumerate(VISION_TOKENS)}
    cfg = tiny_vl_config(64, token_ids=ids, family=family, hidden_size=32, num_heads=2, num_kv_heads=1,
                         vision_depth=1, vision_hidden_size=16, vision_intermediate_size=32, vision_num_heads=2)
    model = getattr(transformers, FAMILIES[family][1])(cfg)
    assert model.config.model_type == family
    lora.inject(model, LoRAConfig(rank=2))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted and all(n.startswith("model.language_model.layers.") for n in adapted)
    assert any(n.endswith("mlp.gate_proj") for n in adapted) and any(n.endswith("q_proj") for n in adapted)
    assert not any(p.requires_grad for p in model.model.visual.parameters())


@pytest.mark.parametrize("overrides, path, words", [
    (["model=tiny_vl", "engine.name=megatron"], "engine.name", "megatron does not train vision-language"),
    (["model=tiny_vl", "engine.name=deepspeed"], "engine.name", "deepspeed does not train vision-language"),
    (["model=tiny_vl", "engine.name=archon", "allocation_mode=hf:d1+archon:d1p2", "cluster.n_gpus_per_node=3"],
     "allocation_mode", "(this plan has p2)"),
    (["model.freeze_vision_tower=true"], "model.freeze_vision_tower", "has no vision tower"),
])
def test_validate_refuses_what_cannot_train_a_vision_model(overrides, path, words):
    from areal_cli.errors import ConfigError
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(overrides))
    assert e.value.path == path and words in str(e.value)


def test_validate_plans_vision_models_on_fsdp_and_archon():
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    validate(load_config(["model=tiny_vl", "model.freeze_vision_tower=true"]))
    validate(load_config(["model=tiny_vl", "engine.name=archon", "allocation_mode=hf:d1+archon:d1t2",
                          "cluster.n_gpus_per_node=3"]))


def test_image_features_go_to_the_image_rows_image_tokens_only():
    """Packed and padded: an image token in a text row, in padding or generated after a row's images takes no
    feature."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(image_token_id=9, vision_config=SimpleNamespace(spatial_merge_size=1))
    ids = torch.tensor([[1, 9, 9, 2, 9], [9, 3, 0, 0, 0], [4, 9, 5, 9, 9]])
    am = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    # row 0: one 1x1x2 image (2 tokens) and a generated pad after it; row 2: two 1x1x1 images
    mm = [{"pixel_values": torch.zeros(2, 3), "image_grid_thw": torch.tensor([[1, 1, 2]])}, None,
          {"pixel_values": torch.zeros(2, 3), "image_grid_thw": torch.tensor([[1, 1, 1], [1, 1, 1]])}]
    mb = {"input_ids": ids, "attention_mask": am, "multi_modal": mm}
    assert vision.image_token_mask(mb, cfg).int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0]]
    packed = vision.image_token_mask(mb, cfg, packed_total=13)
    assert packed.int().tolist() == [[0, 1, 1, 0, 0] + [0, 0] + [0, 1, 0, 1] + [0, 0]]
