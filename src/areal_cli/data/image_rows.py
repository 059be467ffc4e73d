"""Images in local dataset files: which column holds them, and each row's images as bytes.

A local dataset is visual when it has an image column: ``dataset.image_key`` names it, else the first of
:data:`IMAGE_KEYS` the file has. A cell holds one image or a list of them, each

- a path (``"a.png"``), relative to the dataset file's directory or absolute (JSONL / JSON rows);
- the HF ``datasets.Image`` feature's ``{"bytes", "path"}`` struct (Parquet, Arrow, a saved ``datasets``
  dir; hiyouga/geometry3k's ``images`` column is a list of them), its bytes used when present, else its path;
- raw PNG/JPEG bytes, a ``data:`` URL or a PIL image.

The prompt text's ``<image>`` placeholders (:data:`PLACEHOLDER`, geometry3k's and verl's/AReaL's convention)
say where each image goes in the chat: the text is cut there and an image part put in each cut. Without
placeholders the images go before the text (as the built-in visual tasks put theirs). A row whose
placeholder count is not its image count, or whose image cannot be read, is a ``DataError`` naming the file
and the row: such a file is broken, and training on a silently thinner copy of it would hide that.

Cheap detection for ``validate-config`` (no image is read): :func:`image_column` on the columns
:mod:`areal_cli.data.sources` peeks at.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from areal_cli.errors import DataError

IMAGE_KEYS = ("images", "image")
PLACEHOLDER = "<image>"


def image_column(names: list[str] | Any, image_key: str | None) -> str | None:
    """The image column among ``names``: ``image_key`` when set (None when the file lacks it), else the first
    of :data:`IMAGE_KEYS` present."""
    if image_key:
        return image_key if image_key in names else None
    return next((k for k in IMAGE_KEYS if k in names), None)


def _read_path(text: str, base_dir: Path, where: str) -> bytes:
    p = Path(text).expanduser()
    if not p.is_absolute():
        p = base_dir / p
    try:
        return p.read_bytes()
    except OSError as e:
        raise DataError(f"{where}: cannot read image file {str(p)!r} ({e.strerror or e}) — fix: image paths are "
                        "relative to the dataset file's directory or absolute; check the file exists") from e


def image_bytes(value: Any, base_dir: Path, where: str) -> bytes:
    """One image cell as encoded image bytes (see the module docstring for the forms), checked to decode."""
    from PIL import Image

    raw: bytes
    if isinstance(value, dict):  # datasets.Image: {"bytes", "path"}
        if value.get("bytes"):
            raw = bytes(value["bytes"])
        elif isinstance(value.get("path"), str) and value["path"]:
            raw = _read_path(value["path"], base_dir, where)
        else:
            raise DataError(f"{where}: an image struct has neither bytes nor a path — fix: re-save the dataset "
                            "with its images embedded (datasets' Image feature)")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    elif isinstance(value, str) and value.startswith("data:"):
        try:
            raw = base64.b64decode(value.split(",", 1)[1], validate=True)
        except (ValueError, IndexError) as e:
            raise DataError(f"{where}: an image data URL is not valid base64 — fix: repair the row") from e
    elif isinstance(value, str) and value.strip():
        raw = _read_path(value.strip(), base_dir, where)
    elif isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.convert("RGB").save(buf, format="PNG")
        raw = buf.getvalue()
    else:
        raise DataError(f"{where}: an image is a {type(value).__name__}, not a path, bytes or an image struct — "
                        "fix: put image paths (or datasets.Image values) in the image column")
    try:
        with Image.open(io.BytesIO(raw)) as im:
            im.verify()  # the header and the data, without decoding the pixels
    except Exception as e:  # PIL raises several types for bad image data
        raise DataError(f"{where}: an image cannot be decoded ({type(e).__name__}: {e}) — fix: replace the "
                        "damaged or non-image file") from e
    return raw


def row_images(cell: Any, base_dir: Path, where: str) -> list[bytes]:
    """A row's images (a cell of one image or a list of them; empty / null: none)."""
    if cell is None:
        return []
    if isinstance(cell, (list, tuple)):
        return [image_bytes(v, base_dir, f"{where} image {k}") for k, v in enumerate(cell)]
    return [image_bytes(cell, base_dir, where)]


def content_parts(text: str, n_images: int, where: str) -> list[dict[str, Any]]:
    """The user turn's content: text cut at each ``<image>`` with an image part in each cut; without
    placeholders the images first, then the text."""
    k = text.count(PLACEHOLDER)
    if k == 0:
        return [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    if k != n_images:
        raise DataError(f"{where}: the prompt has {k} {PLACEHOLDER} placeholder(s) for {n_images} image(s) — fix: "
                        f"give each image one {PLACEHOLDER} in the prompt text, or none (the images then go "
                        "before the text)")
    parts: list[dict[str, Any]] = []
    pieces = text.split(PLACEHOLDER)
    for i, piece in enumerate(pieces):
        if piece.strip():
            parts.append({"type": "text", "text": piece})
        if i < n_images:
            parts.append({"type": "image"})
    return parts


def visual_rows(rows: list[dict], column: str, prompt_field: str, base_dir: Path, source: str,
                indices: list[int] | None = None) -> list[dict]:
    """Rows with their images as bytes under ``"images"`` (the form the visual-task item builder reads);
    every image is read and checked here, so a broken one fails the load, naming its row."""
    where_of = indices if indices is not None else range(len(rows))
    out = []
    for i, row in zip(where_of, rows):
        if not isinstance(row, dict):
            out.append(row)
            continue
        where = f"{source} row {i}"
        cell = row.get(column)
        if cell is None and column in IMAGE_KEYS:  # auto-detected: a row may spell it the other way
            cell = next((row[k] for k in IMAGE_KEYS if row.get(k) is not None), None)
        imgs = row_images(cell, base_dir, where)
        q = row.get(prompt_field)
        if isinstance(q, str) and imgs:
            content_parts(q, len(imgs), where)  # raises on a placeholder/image count mismatch
        new = {k: v for k, v in row.items() if k not in (column, "image", "images")}
        new["images"] = imgs
        out.append(new)
    return out
