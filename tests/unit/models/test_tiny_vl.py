"""The built-in tiny Qwen2.5-VL and Qwen2-VL: built here, load offline with transformers' own classes, render
image content parts, run a forward and generate on an image, are seeded, and match their ``model=tiny_vl`` /
``model=tiny_qwen2_vl`` presets."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from areal_cli.data import builtin_vision as bv  # noqa: E402
from areal_cli.data.builtin_model import BUILTIN_SPECS, ensure_builtin_model, resolve_spec  # noqa: E402
from areal_cli.models.tiny_vl import VL_CHAT_TEMPLATE, load_vl_processor, make_tiny_vl_model  # noqa: E402


# builtin model name -> its transformers class
MODELS = {"tiny_vl": "Qwen2_5_VLForConditionalGeneration", "tiny_qwen2_vl": "Qwen2VLForConditionalGeneration"}


@pytest.fixture(scope="module", params=list(MODELS))
def vl_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, vl_name) -> str:
    return ensure_builtin_model(tmp_path_factory.mktemp("fileroot"), vl_name)


@pytest.fixture(scope="module")
def model_cls(vl_name):
    import transformers

    return getattr(transformers, MODELS[vl_name])


def _image(seed: int):
    from PIL import Image

    row = bv.generate_splits("count_shapes", 1, 1, seed=seed)[0][0]
    return Image.open(io.BytesIO(row["image"])).convert("RGB"), row["question"]


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def test_loads_offline_renders_images_and_runs(vl_dir, model_cls):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:  # transformers builds a Qwen2-VL processor only with a video processor, which needs torchvision
        AutoProcessor.from_pretrained(vl_dir)
    except ImportError as e:
        assert "torchvision" in str(e).lower()
    proc = load_vl_processor(vl_dir)
    model = model_cls.from_pretrained(vl_dir).eval()
    assert type(AutoModelForImageTextToText.from_pretrained(vl_dir)) is model_cls
    assert type(proc).__name__.endswith(model_cls.__name__.replace("ForConditionalGeneration", "Processor"))
    tok = proc.tokenizer
    img, question = _image(0)

    prompt = proc.apply_chat_template(_chat(question), add_generation_prompt=True, tokenize=False)
    assert prompt == (f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    batch = proc(images=[img], text=[prompt], return_tensors="pt")
    # 64x64 px: 8x8 patches of 8 px, merged 2x2 into 16 image tokens
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert tuple(batch["pixel_values"].shape) == (64, 3 * 2 * 8 * 8)
    ids = batch["input_ids"][0].tolist()
    assert ids.count(model.config.image_token_id) == 16
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")

    with torch.no_grad():
        logits = model(**batch).logits
        assert tuple(logits.shape) == (1, len(ids), len(tok)) and torch.isfinite(logits).all()
        # the picture reaches the logits: another image under the same text changes them
        other = proc(images=[_image(1)[0]], text=[prompt], return_tensors="pt")
        assert other["input_ids"].tolist() == batch["input_ids"].tolist()
        assert not torch.allclose(model(**other).logits, logits)
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and len(ids) < out.shape[1] <= len(ids) + 4
    assert out[0, :len(ids)].tolist() == ids


def test_the_dirs_own_processor_loads_when_its_code_is_trusted(vl_dir, model_cls):
    """vLLM loads the processor with trust_remote_code (docs/vision.md): the dir's processing_tiny_vl.py gives
    the family's images-only processor, which processes a picture as load_vl_processor's does."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(vl_dir, trust_remote_code=True)
    stock = model_cls.__name__.replace("ForConditionalGeneration", "Processor")
    assert type(proc).__name__ == f"ImagesOnly{stock}" and not hasattr(proc, "video_processor")
    assert json.loads((Path(vl_dir) / "processor_config.json").read_text())["processor_class"] == stock
    img, question = _image(0)
    ref = load_vl_processor(vl_dir)
    prompt = ref.apply_chat_template(_chat(question), add_generation_prompt=True, tokenize=False)
    a, b = (p(images=[img], text=[prompt], return_tensors="pt") for p in (proc, ref))
    assert a["input_ids"].tolist() == b["input_ids"].tolist() and torch.equal(a["pixel_values"], b["pixel_values"])


def test_config_matches_the_preset_and_the_estimate(vl_dir, vl_name, model_cls):
    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.config.model import vision_tower_params
    from areal_cli.data.builtin_model import builtin_model_dir, overrides_from_model_config
    from areal_cli.plan.compose import load_config

    cfg = load_config([f"model={vl_name}"])
    assert cfg.model.path == f"builtin:{vl_name}" and cfg.model.vision.depth == 2
    # the preset's facts build the same cached model as the spec (no second build under another name)
    assert resolve_spec(vl_name, overrides_from_model_config(cfg.model)) == BUILTIN_SPECS[vl_name]
    assert Path(vl_dir) == builtin_model_dir(Path(vl_dir).parent.parent, vl_name)
    # the path alone under the vision experiment (whose preset is tiny_vl) builds the model the path names
    path_only = load_config(["experiment=vision_default", f"model.path=builtin:{vl_name}"])
    assert resolve_spec(vl_name, overrides_from_model_config(path_only.model)) == BUILTIN_SPECS[vl_name]

    model = model_cls.from_pretrained(vl_dir)
    visual = sum(p.numel() for p in model.model.visual.parameters())
    assert vision_tower_params(cfg.model.vision, cfg.model.hidden_size) == visual
    assert ModelFacts.from_config(cfg.model).vision == visual
    assert model.config.text_config.vocab_size <= cfg.model.vocab_size  # the preset's bound holds
    total = sum(p.numel() for p in model.parameters())
    assert total < 1_000_000  # a CPU toy: ~0.75M

    saved = json.loads((Path(vl_dir) / "config.json").read_text())
    assert saved["model_type"] == BUILTIN_SPECS[vl_name].family == cfg.model.vision.family
    assert saved["text_config"]["rope_parameters"]["mrope_section"] == [4, 6, 6]  # sums to head_dim/2 = 16
    # the merger's output width: Qwen2.5-VL's out_hidden_size, Qwen2-VL's hidden_size
    out_key = "hidden_size" if vl_name == "tiny_qwen2_vl" else "out_hidden_size"
    assert saved["vision_config"][out_key] == cfg.model.hidden_size
    # a local dir's config.json supplies the vision facts as a preset does (Qwen2-VL's names mapped)
    local = load_config([f"model.path={vl_dir}"])
    assert local.model.vision == cfg.model.vision
    assert ModelFacts.from_config(local.model).vision == visual


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_same_seed_same_weights_other_seed_other_weights(tmp_path, family):
    from safetensors.torch import load_file

    corpus = bv.corpus("count_shapes", n=50)
    small = dict(hidden_size=32, num_heads=2, num_kv_heads=1, vision_hidden_size=32, vision_num_heads=2,
                 vision_intermediate_size=32, family=family)
    dirs = [make_tiny_vl_model(tmp_path / f"m{i}", corpus, seed=s, **small) for i, s in enumerate((0, 0, 1))]
    w = [load_file(str(Path(d) / "model.safetensors")) for d in dirs]
    assert w[0].keys() == w[1].keys() == w[2].keys()
    assert any(k.startswith("visual.blocks.") for k in w[0])  # the hub checkpoint layout (visual.*, model.*)
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])
    assert not all(torch.equal(w[0][k], w[2][k]) for k in w[0])
    assert (Path(dirs[0]) / "tokenizer.json").read_bytes() == (Path(dirs[1]) / "tokenizer.json").read_bytes()
    assert (Path(dirs[0]) / "chat_template.jinja").read_text() == VL_CHAT_TEMPLATE


def test_image_features_reach_the_answer_position(vl_dir, model_cls):
    """What SFT on a visual task needs: the picture moves the logits where the answer's number is predicted,
    the answer loss has a gradient into the tower's first and last layers, and the image tokens get mrope's
    2-D (row, column) positions from what the processor returns (without ``mm_token_type_ids`` transformers
    falls back to 1-D positions)."""
    proc = load_vl_processor(vl_dir)
    model = model_cls.from_pretrained(vl_dir)
    rows = [r for r in bv.generate_splits("count_shapes", 12, 1, seed=5)[0]]
    a = rows[0]
    b = next(r for r in rows if r["image"] != a["image"])
    from PIL import Image

    prompt = proc.apply_chat_template(a["messages"], add_generation_prompt=True, tokenize=False)
    text = prompt + "There are "
    pictures = [Image.open(io.BytesIO(r["image"])).convert("RGB") for r in (a, b)]
    batches = [proc(images=[p], text=[text], return_tensors="pt") for p in pictures]
    assert "mm_token_type_ids" in batches[0]
    ids = batches[0]["input_ids"]
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=batches[0]["mm_token_type_ids"],
                                        image_grid_thw=batches[0]["image_grid_thw"],
                                        attention_mask=batches[0]["attention_mask"])
    image = ids[0] == model.config.image_token_id
    rows_, cols = pos[1, 0][image], pos[2, 0][image]
    assert sorted(set(zip(rows_.tolist(), cols.tolist()))) == [(r + rows_.min().item(), c + cols.min().item())
                                                                 for r in range(4) for c in range(4)]

    with torch.no_grad():
        la, lb = (model(**x).logits[0, -1] for x in batches)
    assert (la - lb).abs().max() > 1e-3 * la.abs().max()  # measured: ~9% of the logit scale at init

    labels = torch.full_like(ids, -100)
    labels[0, -1] = ids[0, -1]  # the loss of one answer token is enough to reach the tower
    model(**batches[0], labels=labels).loss.backward()
    for name in ("model.visual.patch_embed.proj.weight", "model.visual.merger.mlp.2.weight"):
        g = dict(model.named_parameters())[name].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


def test_weight_updates_reach_every_checkpoint_tensor(vl_dir, model_cls):
    """The hf server takes a weight update under the hub checkpoint's names (the trainer's: engines/vision.py
    hub_name): every tensor of the model dir's checkpoint has a live tensor of its shape under that name."""
    from safetensors import safe_open

    from areal_cli.engines.vision import hub_name
    from areal_cli.inference.server.weights import model_params

    model = model_cls.from_pretrained(vl_dir)
    live = model_params(model)
    with safe_open(f"{vl_dir}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names and all(n in live and live[n].shape == f.get_tensor(n).shape for n in names)
    assert {hub_name(n) for n, _ in model.named_parameters()} - {"lm_head.weight"} == names
