"""Images in requests to the ``hf`` server: where they may come from, how big they may be, and how a
prompt's image placeholders become the image tokens the model sees.

An image reference is a ``data:image/...;base64,`` URL, bare base64 (SGLang's ``image_data`` takes it),
or a local path / ``file://`` URL under one of the server's ``--allowed-media-roots`` (none by default).
``http(s)://`` URLs are refused: the server never fetches anything (it runs offline next to the trainer).

Placeholders (after SGLang 0.5.23's Qwen-VL processor, which decodes ``input_ids`` to text and takes each
``<|vision_start|>(<|image_pad|>)+<|vision_end|>`` as one image; the delimiters are not required here):
every maximal run of ``<|image_pad|>`` ids in the prompt is one image, in order. A run of one pad is expanded to the image's token count (the chat
template's form); a run that already has exactly that many pads (a processor's output, or a resubmitted
prompt) is kept. Any other length is a 400: the trainer needs the ids the model saw, and silently
re-expanding would hand it ids it never sent. The expanded prompt is returned as
``meta_info.prompt_token_ids``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any

from areal_cli.inference.server.schema import BadRequest

# Raw (decoded) pixels one image may have before the processor resizes it: a decompression bomb is
# refused from its header, before its pixels are decoded. 4096 x 4096 by default.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES_PER_REQUEST = 64


@dataclass
class VisionInputs:
    """One prompt's images as the model takes them."""

    pixel_values: Any  # [patches, C * T * P * P] float tensor, the images' patches concatenated
    image_grid_thw: Any  # [n_images, 3] long tensor
    tokens_per_image: list[int]


@dataclass
class MediaPolicy:
    allowed_roots: list[str]
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_tokens: int | None = None  # per request, all images together; None: the context length bounds it


def _under(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def image_bytes(ref: Any, policy: MediaPolicy, where: str) -> bytes:
    """The encoded bytes an image reference names (400 with the reason when it names none)."""
    if isinstance(ref, dict):  # OpenAI's {"url": ...} inside an image_url part
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise BadRequest(f"{where}: an image must be a data URL, base64 or a local path, got "
                         f"{type(ref).__name__}")
    low = ref[:16].lower()
    if low.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: the hf server does not fetch URLs (it runs offline); send the image as a "
                         "data:image/...;base64 URL or base64 in image_data")
    if low.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep or ";base64" not in head.lower():
            raise BadRequest(f"{where}: a data URL must be data:image/<type>;base64,<data>")
        if not head[5:].lower().startswith("image/"):
            raise BadRequest(f"{where}: data URL media type {head[5:].split(';')[0]!r} is not an image")
        return _b64(data, where)
    if low.startswith("file://") or ref.startswith(("/", "./", "~")):
        path = os.path.expanduser(ref[7:] if low.startswith("file://") else ref)
        if not policy.allowed_roots:
            raise BadRequest(f"{where}: local image paths are not allowed on this server (start it with "
                             "--allowed-media-roots DIR to allow them); send a data URL")
        if not _under(path, policy.allowed_roots):
            raise BadRequest(f"{where}: {path} is outside the server's allowed media roots "
                             f"{policy.allowed_roots}")
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise BadRequest(f"{where}: cannot read {path}: {e.strerror}") from None
    return _b64(ref, where)


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: not valid base64 (nor a data URL or a local path)") from None


def decode_image(raw: bytes, policy: MediaPolicy, where: str):
    """A PIL RGB image; 400 for bytes that are not an image or whose header exceeds the pixel budget."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(raw))
        w, h = img.size
    except Exception as e:  # PIL raises several types for unreadable headers
        raise BadRequest(f"{where}: cannot decode the image ({type(e).__name__}: {e})") from None
    if w * h > policy.max_image_pixels:
        raise BadRequest(f"{where}: the image is {w}x{h} = {w * h} pixels, over this server's "
                         f"--max-image-pixels {policy.max_image_pixels}")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # truncated or corrupt pixel data
        raise BadRequest(f"{where}: cannot decode the image ({type(e).__name__}: {e})") from None


class MediaHandler:
    """Loads a request's images and expands its placeholders (request threads; no model state)."""

    def __init__(self, image_processor: Any, image_token_id: int, policy: MediaPolicy):
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.policy = policy

    def count_runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """``(start, length)`` of each maximal run of image pads in ``ids``."""
        runs, i, t = [], 0, self.image_token_id
        while i < len(ids):
            if ids[i] == t:
                j = i
                while j < len(ids) and ids[j] == t:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        return runs

    def prepare(self, ids: list[int], refs: list[Any], where: str = "image_data") -> tuple[list[int], VisionInputs]:
        """The expanded prompt and its :class:`VisionInputs` (400 on any problem with the images)."""
        import torch

        if len(refs) > MAX_IMAGES_PER_REQUEST:
            raise BadRequest(f"{where}: {len(refs)} images exceed {MAX_IMAGES_PER_REQUEST} per prompt")
        runs = self.count_runs(ids)
        if len(runs) != len(refs):
            raise BadRequest(f"the prompt has {len(runs)} image placeholder(s) (runs of <|image_pad|>, id "
                             f"{self.image_token_id}) but {len(refs)} image(s) were sent")
        pix, grids, counts = [], [], []
        for k, ref in enumerate(refs):
            w = f"{where}[{k}]"
            img = decode_image(image_bytes(ref, self.policy, w), self.policy, w)
            try:
                out = self.image_processor(images=[img], return_tensors="pt")
            except Exception as e:  # e.g. an image too thin for the patch grid
                raise BadRequest(f"{w}: the image processor refused the image ({type(e).__name__}: {e})") from None
            grid = out["image_grid_thw"]
            pix.append(out["pixel_values"])
            grids.append(grid)
            counts.append(int(grid.prod()) // (self.merge * self.merge))
        cap = self.policy.max_image_tokens
        if cap is not None and sum(counts) > cap:
            raise BadRequest(f"the images take {sum(counts)} tokens ({counts}), over this server's "
                             f"--max-image-tokens {cap} per request")
        out_ids: list[int] = []
        at = 0
        for (start, length), n in zip(runs, counts):
            if length not in (1, n):
                raise BadRequest(f"an image placeholder has {length} <|image_pad|> tokens but its image takes "
                                 f"{n}: send one pad per image (expanded here) or exactly {n}")
            out_ids += ids[at:start] + [self.image_token_id] * n
            at = start + length
        out_ids += ids[at:]
        return out_ids, VisionInputs(torch.cat(pix), torch.cat(grids).long(), counts)


def refs_for_prompts(image_data: Any, n_prompts: int, batch: bool) -> list[list[Any]]:
    """SGLang's ``image_data``: one image or a list for a single prompt; for a batch, one entry (an image,
    a list, or null) per prompt."""
    if image_data is None:
        return [[] for _ in range(n_prompts)]
    if not batch:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != n_prompts:
        raise BadRequest(f"image_data for a batch of {n_prompts} prompts must be a list of {n_prompts} "
                         "entries (an image, a list of images, or null each)")
    return [[] if x is None else (x if isinstance(x, list) else [x]) for x in image_data]
