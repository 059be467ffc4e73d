"""Build a tiny Qwen2.5-VL or Qwen2-VL (vision tower + merger + mrope language model) and its processor locally.

Like :mod:`areal_cli.models.tiny`, nothing comes from the hub: the tokenizer is the locally trained BPE
(:func:`~areal_cli.models.tiny.train_tokenizer`) extended with Qwen's vision special tokens, the image
processor is ``Qwen2VLImageProcessor`` with a small patch, and the weights are a seeded random init of
``Qwen2_5_VLForConditionalGeneration`` (``family="qwen2_5_vl"``) or ``Qwen2VLForConditionalGeneration``
(``family="qwen2_vl"``: LayerNorm blocks with a plain GELU MLP, no windowed attention). Both families share
the tokenizer, chat template, image processor and language model; only the tower and the classes differ.
The dir is an ordinary HF dir: ``config.json`` + ``model.safetensors``, the tokenizer files,
``chat_template.jinja``, ``preprocessor_config.json`` and ``processor_config.json``, plus
``processing_tiny_vl.py`` (the images-only processor for loaders that trust the dir's code, named in
``processor_config.json``'s ``auto_map``: vLLM, docs/vision.md).

With the default sizes a 64x64 image is 8x8 patches of 8 px, merged 2x2 into 16 image tokens: one
token per 16x16 cell, which is what the built-in visual task draws its shapes on
(:mod:`areal_cli.data.builtin_vision`).

``transformers``' ``Qwen2_5_VLProcessor`` (and ``Qwen2VLProcessor``) requires a video processor, and its video
processor requires torchvision; where torchvision is missing (this CPU image) ``AutoProcessor.from_pretrained`` raises an
``ImportError`` for any Qwen2-VL-family dir. :func:`load_vl_processor` then builds the same processor
without a video processor (images only) from the same files.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from areal_cli.models.tiny import CHAT_TEMPLATE, train_tokenizer

# Qwen2-VL's special tokens for images and videos, in Qwen's order (the ids differ: ours follow the BPE).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# The images-only processor's file in the model dir (a copy of tiny_vl_processing.py).
PROCESSOR_MODULE = "processing_tiny_vl"

# The text template of tiny.py, with list contents rendered part by part the way Qwen2-VL's template does:
# an image part ({"type": "image"} / "image_url", or a dict holding an "image" key) becomes one
# IMAGE_PLACEHOLDER (the processor expands <|image_pad|> to the image's token count), a video part its
# video placeholder, a text part its text.
_PARTS = (
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part is string %}{{ part }}"
    "{% elif part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part %}"
    "{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
)
_STRING_CONTENT = "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
if _STRING_CONTENT not in CHAT_TEMPLATE:  # a change to tiny.py's template must be carried over here
    raise RuntimeError("models/tiny.py's CHAT_TEMPLATE no longer has the content line tiny_vl.py extends")
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    _STRING_CONTENT, "{% if message['content'] is string %}{{ message['content'] }}" + _PARTS + "{% endif %}")


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary half-dim into (temporal, height, width) sections: 1/4, 3/8, 3/8
    (``[16, 24, 24]`` for the real models' head_dim 128)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


# family (the HF model_type) -> (config class, model class, processor class), by name in transformers
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
}


def _family(family: str) -> tuple[str, str, str]:
    if family not in FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def tiny_vl_config(vocab_size: int, *, token_ids: dict[str, int], family: str = "qwen2_5_vl",
                   hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                   intermediate_size: int | None = None, max_position_embeddings: int = 512,
                   vision_depth: int = 2, vision_hidden_size: int = 64, vision_intermediate_size: int = 128,
                   vision_num_heads: int = 4, patch_size: int = 8, spatial_merge_size: int = 2,
                   temporal_patch_size: int = 2, tie_word_embeddings: bool = True, eos_token_id: int | None = None,
                   pad_token_id: int | None = None):
    """A ``Qwen2_5_VLConfig`` or ``Qwen2VLConfig``: the language model as tiny.py's Qwen2 (with mrope), a ViT
    of ``vision_depth`` blocks and the 2-layer merger into ``hidden_size``. Qwen2.5-VL's last block attends
    over the whole image, the others in windows of 4x4 merged tokens (as the real model's windows are);
    Qwen2-VL has no windows, and its MLP width is ``vision_hidden_size * mlp_ratio`` (an integer ratio)."""
    import transformers

    head_dim = hidden_size // num_heads
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": mrope_section(head_dim)},
                eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)
    common = dict(depth=vision_depth, num_heads=vision_num_heads, patch_size=patch_size,
                  temporal_patch_size=temporal_patch_size, spatial_merge_size=spatial_merge_size)
    if family == "qwen2_vl":
        if vision_intermediate_size % vision_hidden_size:
            raise ValueError(f"Qwen2-VL's vision MLP width is hidden_size * mlp_ratio (an integer): "
                             f"{vision_intermediate_size} is not a multiple of {vision_hidden_size}")
        vision = dict(common, embed_dim=vision_hidden_size, mlp_ratio=vision_intermediate_size // vision_hidden_size,
                      hidden_size=hidden_size)
    else:
        vision = dict(common, hidden_size=vision_hidden_size, intermediate_size=vision_intermediate_size,
                      out_hidden_size=hidden_size, window_size=4 * spatial_merge_size * patch_size,
                      fullatt_block_indexes=[vision_depth - 1])
    config_cls = getattr(transformers, _family(family)[0])
    return config_cls(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                      image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
                      vision_start_token_id=token_ids["<|vision_start|>"],
                      vision_end_token_id=token_ids["<|vision_end|>"])


def tiny_qwen2_5_vl_config(vocab_size: int, *, token_ids: dict[str, int], **kwargs):
    """:func:`tiny_vl_config` of a Qwen2.5-VL."""
    return tiny_vl_config(vocab_size, token_ids=token_ids, family="qwen2_5_vl", **kwargs)


def add_vision_tokens(tokenizer) -> None:
    """Append Qwen's vision special tokens to a tiny.py tokenizer (existing ids are unchanged) and set the
    image-rendering chat template."""
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE


def image_processor(patch_size: int = 8, temporal_patch_size: int = 2, merge_size: int = 2,
                    min_pixels: int = 16 * 16, max_pixels: int = 128 * 128):
    """Qwen2-VL's image processor (the PIL backend: no torchvision needed) for the tiny model's patch."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                    merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels)


def make_tiny_vl_model(out_dir: str | os.PathLike, corpus: Iterable[str], *, seed: int = 0,
                       vocab_size: int = 400, max_pixels: int = 128 * 128, family: str = "qwen2_5_vl",
                       **config_kwargs) -> str:
    """Write a seeded random tiny Qwen2.5-VL (or Qwen2-VL: ``family="qwen2_vl"``), its tokenizer, image
    processor and chat template to ``out_dir``.

    ``corpus`` trains the BPE (``vocab_size``: the whole vocabulary, vision tokens included); ``config_kwargs`` go to
    :func:`tiny_vl_config` (its ``patch_size``/``spatial_merge_size``/``temporal_patch_size`` also
    configure the image processor)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    _, model_cls, processor_cls = _family(family)

    transformers.utils.logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, corpus, vocab_size=vocab_size - len(VISION_TOKENS),
                    model_max_length=config_kwargs.get("max_position_embeddings", 512))
    tok = AutoTokenizer.from_pretrained(str(out))
    add_vision_tokens(tok)
    tok.save_pretrained(str(out))
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(VISION_TOKENS)))
    image_processor(patch_size=config_kwargs.get("patch_size", 8),
                    temporal_patch_size=config_kwargs.get("temporal_patch_size", 2),
                    merge_size=config_kwargs.get("spatial_merge_size", 2),
                    max_pixels=max_pixels).save_pretrained(str(out))
    # What ProcessorMixin.save_pretrained writes; it cannot run here (it needs the video processor). The
    # auto_map is for loaders that trust the dir's code (vLLM: docs/vision.md); others keep processor_class.
    shutil.copyfile(Path(__file__).with_name("tiny_vl_processing.py"), out / f"{PROCESSOR_MODULE}.py")
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": processor_cls,
         "auto_map": {"AutoProcessor": f"{PROCESSOR_MODULE}.ImagesOnly{processor_cls}"}}, indent=2))
    cfg = tiny_vl_config(len(tok), token_ids=ids, family=family, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **config_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def load_vl_processor(model_dir: str | os.PathLike):
    """The dir's ``Qwen2_5_VLProcessor`` (``Qwen2VLProcessor`` for a Qwen2-VL dir): ``AutoProcessor`` where it
    can build one; without torchvision (no video processor) the same processor for images only, from the same
    files."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(str(model_dir))
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return _images_only_processor_class(_processor_class_name(model_dir))(
        image_processor=AutoImageProcessor.from_pretrained(str(model_dir)), tokenizer=tok,
        chat_template=tok.chat_template)


def _processor_class_name(model_dir: str | os.PathLike) -> str:
    """The processor class the dir names (``processor_config.json``), else its family's (``config.json``)."""
    d = Path(model_dir)
    try:
        name = json.loads((d / "processor_config.json").read_text()).get("processor_class")
    except (OSError, ValueError):
        name = None
    if name in {p for _, _, p in FAMILIES.values()}:
        return name
    try:
        model_type = json.loads((d / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    return FAMILIES.get(model_type, FAMILIES["qwen2_5_vl"])[2]


def _images_only_processor_class(name: str = "Qwen2_5_VLProcessor"):
    from areal_cli.models import tiny_vl_processing

    return getattr(tiny_vl_processing, f"ImagesOnly{name}")
