"""A small deterministic image environment for the built-in visual tasks: after a wrong answer the model gets a
new picture with a hint drawn on it (the multi-turn workflow's ``image_feedback``, docs/vision.md).

:func:`frame_shapes` is such a feedback function: ``(data item, turn, completion) -> image``. It reads the
item's picture (the 4x4 grid of 16 px cells of :mod:`areal_cli.data.builtin_vision`), finds the cells that
hold a shape from the pixels (and, when the item asks about one colour, the cells of that colour) and returns
the picture with a black frame around each of them, as PNG bytes. Each frame stays inside its cell, so each
merged image token of the tiny VLM still sees one cell. Same item, same picture: the hint is deterministic.
"""

from __future__ import annotations

import io
from typing import Any

from areal_cli.models.vl_inputs import item_images, to_pil

CELL = 16
_RGB = {"red": 0, "green": 1, "blue": 2}


def shape_cells(img: Any, colour: str | None = None) -> list[int]:
    """Indices (row-major) of the 16 px cells holding a shape (of ``colour``, when given)."""
    pil = to_pil(img)
    cols, rows = pil.width // CELL, pil.height // CELL
    px = pil.load()
    out = []
    for c in range(cols * rows):
        x0, y0 = (c % cols) * CELL, (c // cols) * CELL
        # the cell's centre pixel is inside the shape (every shape is centred in its cell, 8 px or larger)
        r, g, b = px[x0 + CELL // 2, y0 + CELL // 2][:3]
        if (r, g, b) == (255, 255, 255):
            continue
        if colour is None or max(range(3), key=lambda i: (r, g, b)[i]) == _RGB.get(colour, -1):
            out.append(c)
    return out


def framed(img: Any, cells: list[int]) -> bytes:
    """The picture with a black 1 px frame on the border of each of ``cells``, as PNG bytes."""
    from PIL import ImageDraw

    pil = to_pil(img).copy()
    cols = pil.width // CELL
    draw = ImageDraw.Draw(pil)
    for c in cells:
        x0, y0 = (c % cols) * CELL, (c // cols) * CELL
        draw.rectangle((x0, y0, x0 + CELL - 1, y0 + CELL - 1), outline=(0, 0, 0))
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return buf.getvalue()


def frame_shapes(data: dict[str, Any], turn: int, completion: str) -> bytes | None:
    """The feedback picture after a wrong answer in ``turn``: the item's picture with the shapes to count
    framed (None when the item has no picture: the plain text feedback goes alone)."""
    imgs = item_images(data)
    if not imgs:
        return None
    return framed(imgs[0], shape_cells(imgs[0], data.get("colour")))
