"""Images in rollouts: what a prompt with images sends to the server and what its trained rows carry.

A data item with images (``"images"``: a list, or ``"image"``: one; each PNG/JPEG bytes, a ``data:`` URL, bare
base64 or a PIL image) has one image placeholder run of ``<|image_pad|>`` ids per image in its prompt (the chat
template's single pad: docs/vision.md). :func:`prompt_images` turns the prompt's ids and the images into

- ``ids``: the prompt with every pad run expanded to its image's token count, exactly as the model's
  processor expands it (``Qwen2_5_VLProcessor``, like ``Qwen2VLProcessor``, replaces each pad by
  ``t*h*w / merge^2`` pads before tokenizing; pads are special tokens, so expanding the ids gives the same ids);
- ``image_data``: the images as data URLs, SGLang's ``image_data`` (``ModelRequest.image_data``);
- ``multi_modal``: ``{"pixel_values", "image_grid_thw"}`` from the same image processor on the same images,
  the row entry of ``batch["multi_modal"]`` (api/engine_api.py), so the trainer's recomputed logprobs see
  what the server saw.

The server keeps a pad run of exactly an image's count (docs/vision.md), so it generates on these ids, and
:func:`check_served_prompt` checks the prompt it reports back (``ModelResponse.input_tokens``) is them.

The image processor is the model dir's (``preprocessor_config.json``), found from the tokenizer's
``name_or_path`` and cached per dir; no torchvision is needed (``Qwen2VLImageProcessorPil``).
"""

from __future__ import annotations

import base64
import functools
import io
from dataclasses import dataclass
from typing import Any

from areal_cli.errors import DataError

IMAGE_PAD = "<|image_pad|>"
# Qwen2-VL's vision special tokens (models/tiny_vl.py VISION_TOKENS); the hf server never samples them for a
# vision-language model (inference/server/vision.py), so a generated one cannot become a placeholder.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def item_images(data: dict[str, Any]) -> list[Any]:
    """The item's images in prompt order (``"images"`` or ``"image"``; none: ``[]``)."""
    imgs = data.get("images")
    if imgs is None and data.get("image") is not None:
        imgs = [data["image"]]
    return list(imgs or [])


def to_pil(img: Any) -> Any:
    """One image as an RGB PIL image: bytes, a ``data:`` URL / bare base64 string, or a PIL image."""
    from PIL import Image

    if isinstance(img, Image.Image):
        return img.convert("RGB")
    if isinstance(img, str):
        raw = img.split(",", 1)[1] if img.startswith("data:") else img
        try:
            img = base64.b64decode(raw, validate=True)
        except ValueError as e:
            raise DataError(f"an image string is neither a data URL nor base64: {img[:40]!r}...") from e
    if isinstance(img, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(bytes(img))).convert("RGB")
        except Exception as e:  # PIL raises several types for undecodable bytes
            raise DataError(f"an image of a data item cannot be decoded: {type(e).__name__}: {e}") from e
    raise DataError(f"an image must be bytes, a data URL or a PIL image, got {type(img).__name__}")


def to_data_url(img: Any) -> str:
    """The image as ``data:image/...;base64,...`` (a data URL stays as it is; PIL images become PNG)."""
    if isinstance(img, str) and img.startswith("data:"):
        return img
    if isinstance(img, str):
        return "data:image/png;base64," + img
    if isinstance(img, (bytes, bytearray, memoryview)):
        raw = bytes(img)
        kind = "jpeg" if raw[:3] == b"\xff\xd8\xff" else "png"
        return f"data:image/{kind};base64," + base64.b64encode(raw).decode("ascii")
    buf = io.BytesIO()
    to_pil(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@functools.lru_cache(maxsize=8)
def _image_processor(model_dir: str) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir)


def image_processor_for(tokenizer: Any) -> Any:
    """The image processor of the model dir ``tokenizer`` was loaded from (a processor's own, if given one)."""
    own = getattr(tokenizer, "image_processor", None)
    if own is not None:
        return own
    path = getattr(tokenizer, "name_or_path", None)
    if not path:
        raise DataError("a data item has images, and the tokenizer names no model dir to read the image "
                        "processor from (a vision-language model dir has preprocessor_config.json)")
    try:
        return _image_processor(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"a data item has images, and {path} has no image processor ({e}); images need a "
                        "vision-language model (model=tiny_vl)") from e


def image_pad_id(tokenizer: Any) -> int:
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    pid = tok.convert_tokens_to_ids(IMAGE_PAD)
    if pid is None or pid == getattr(tok, "unk_token_id", None):
        raise DataError(f"a data item has images, and the tokenizer has no {IMAGE_PAD} token: the model is not a "
                        "Qwen2-VL-family vision-language model (model=tiny_vl)")
    return int(pid)


def vision_token_ids(tokenizer: Any) -> list[int]:
    """The ids of the vision special tokens the tokenizer has (none for a text tokenizer)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    vocab = tok.get_vocab()
    return sorted(int(vocab[t]) for t in VISION_TOKENS if t in vocab)


def image_features(processor: Any, images: list[Any]) -> tuple[dict[str, Any], list[int]]:
    """``({"pixel_values", "image_grid_thw"}, image token count of each image)``."""
    out = processor(images=[to_pil(i) for i in images], return_tensors="pt")
    grid = out["image_grid_thw"]
    merge = int(getattr(processor, "merge_size", 2))
    counts = [int(n) for n in (grid.prod(dim=-1) // (merge * merge)).tolist()]
    return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, counts


def expand_pads(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """Each maximal run of ``pad_id`` is one image, in order: a run of one pad becomes ``counts[i]`` pads, a run
    of exactly ``counts[i]`` is kept (the hf server's rule); anything else is a DataError."""
    out: list[int] = []
    k = i = 0
    while i < len(ids):
        if ids[i] != pad_id:
            out.append(int(ids[i]))
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == pad_id:
            j += 1
        if k >= len(counts):
            raise DataError(f"the prompt has more image placeholders than its {len(counts)} image(s)")
        if j - i not in (1, counts[k]):
            raise DataError(f"image placeholder {k} is a run of {j - i} pads; image {k} has {counts[k]} tokens")
        out.extend([pad_id] * counts[k])
        k += 1
        i = j
    if k != len(counts):
        raise DataError(f"the prompt has {k} image placeholder(s) for {len(counts)} image(s); each image needs "
                        "one (an image content part of the chat renders it)")
    return out


@dataclass
class PromptImages:
    ids: list[int]  # the prompt, image pads expanded
    image_data: list[str]  # data URLs, in prompt order
    multi_modal: dict[str, Any]  # {"pixel_values", "image_grid_thw"} of all the images
    pad_id: int | None = None  # the image placeholder's id (ModelRequest.image_pad_id)

    @property
    def n_images(self) -> int:
        return len(self.image_data)


def prompt_images(tokenizer: Any, ids: list[int], images: list[Any], processor: Any = None) -> PromptImages:
    """The expanded prompt, the images to send and the row's ``multi_modal`` (see the module doc)."""
    proc = processor if processor is not None else image_processor_for(tokenizer)
    feats, counts = image_features(proc, images)
    pad = image_pad_id(tokenizer)
    return PromptImages(expand_pads(list(ids), pad, counts), [to_data_url(i) for i in images], feats, pad)


def item_prompt_images(tokenizer: Any, data: dict[str, Any], ids: list[int],
                       processor: Any = None) -> PromptImages | None:
    """:func:`prompt_images` of a data item, or None for an item without images."""
    imgs = item_images(data)
    return prompt_images(tokenizer, ids, imgs, processor) if imgs else None


def check_served_prompt(sent: list[int], served: list[int]) -> list[int]:
    """The prompt the server reports it generated on must be the expanded prompt the trainer's row holds
    (its ``multi_modal`` is for those ids)."""
    if list(served) != list(sent):
        from areal_cli.errors import InferenceError

        raise InferenceError(f"the server expanded the image prompt to {len(served)} ids, the processor to "
                             f"{len(sent)}: the server's image processor is not the trainer's (same model dir?)")
    return list(served)


def merge_multi_modal(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's ``multi_modal`` from several images' features (a multi-turn row: its images in order)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    return {"pixel_values": torch.cat([p["pixel_values"] for p in parts], dim=0),
            "image_grid_thw": torch.cat([p["image_grid_thw"] for p in parts], dim=0)}


def image_token_count(tokenizer: Any, width: int, height: int) -> int:
    """Image tokens of one ``width`` x ``height`` image after the processor's resize (for the prompt-length
    check: a prompt's length counts its images' tokens)."""
    proc = image_processor_for(tokenizer)
    merge = int(getattr(proc, "merge_size", 2))
    return int(proc.get_number_of_image_patches(int(height), int(width), {})) // (merge * merge)
