"""The built-in visual tasks: count shapes in a small rendered image, generated with PIL.

``generate_splits(task, train_size, test_size, seed)`` returns rows like the text task's
(:mod:`areal_cli.data.builtin`), plus the image::

    {"id": "count_shapes-train-0", "question": "How many red shapes are in the image?",
     "image": b"\\x89PNG...", "width": 64, "height": 64,
     "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": <question>}]}],
     "answer": "There are 2 red shapes.\\n#### 2", "ground_truth": "2", "colour": "red"}

Two tasks (:data:`VISION_TASKS`): ``count_shapes`` asks how many shapes of one colour (red, green or blue;
2 to 6 shapes, the answer may be 0); ``count_all`` asks how many shapes there are (3 to 12; ``colour`` is
``None``).
``count_all`` is :data:`DEFAULT_TASK`, the one the tiny VLM learns: a 2-layer language model does not learn
``count_shapes`` by SFT (it must first read the colour from the question, then count only that colour's
image tokens; a text-only version of it did not learn in 600 steps either), while it learns to count
every shape in about 150 steps (docs/vision.md, ``benchmarks/vl_learnability.py``).

The image is PNG bytes: rows stay plain data (they pickle, go into a ``datasets`` table or a parquet file as a
binary column), ``PIL.Image.open(io.BytesIO(row["image"]))`` reads it back, and :func:`image_data_url` makes
the OpenAI ``image_url`` form. The answer ends in ``#### n``, so the math/numeric rewards score it.

A picture is a 64x64 white canvas cut into a 4x4 grid of 16 px cells; 2 to 6 (``count_shapes``) or 3 to
12 (``count_all``) cells hold a filled square or circle in red, green or blue, of a random size. The cell is
the tiny VLM's merged image token (8 px patches, 2x2 merge: :mod:`areal_cli.models.tiny_vl`), so each token
sees one whole shape or none: counting is reading each token (shape or blank) and adding.

Train and test come from independent RNG streams, and a test item never has the picture (cells, colours,
shapes, sizes) of any train item, whatever colour either asks about: held-out accuracy is measured on images
the model never saw. The same ``(task, split sizes, seed)`` gives the same rows, bytes included, on any
machine with the same Pillow and zlib.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

from areal_cli.data.builtin import registry_spec
from areal_cli.errors import ConfigError

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 60, 220)}
SHAPES = ("square", "circle")
CELL = 16
GRID = 4
SIZE = CELL * GRID

# Salts that keep the train and test streams apart for one seed (distinct from builtin.py's).
_SPLIT_SALT = {"train": 0x7151_0001, "test": 0x7151_0002}


@dataclass(frozen=True)
class Picture:
    """Occupied cells as ``(cell index, colour, shape, side px)``, sorted by cell."""

    items: tuple[tuple[int, str, str, int], ...]

    def count(self, colour: str) -> int:
        return sum(1 for _, c, _, _ in self.items if c == colour)


@dataclass(frozen=True)
class VisionTaskSpec:
    min_shapes: int
    max_shapes: int
    question: str = "colour"  # colour: count one colour's shapes | all: count every shape
    colours: tuple[str, ...] = tuple(COLOURS)  # the colours a "colour" question may ask about


VISION_TASKS: dict[str, VisionTaskSpec] = {
    "count_shapes": VisionTaskSpec(min_shapes=2, max_shapes=6),
    "count_all": VisionTaskSpec(min_shapes=3, max_shapes=12, question="all"),
}


# The task `experiment=vision_default` trains on (docs/vision.md says why this one).
DEFAULT_TASK = "count_all"


def task_names() -> list[str]:
    return sorted(VISION_TASKS)


def _spec(task: str) -> VisionTaskSpec:
    return registry_spec(VISION_TASKS, task, "built-in visual task")


def draw_picture(rng: random.Random, spec: VisionTaskSpec) -> Picture:
    k = rng.randint(spec.min_shapes, spec.max_shapes)
    cells = sorted(rng.sample(range(GRID * GRID), k))
    return Picture(tuple((c, rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.randint(8, 13)) for c in cells))


def render(picture: Picture) -> bytes:
    """The picture as PNG bytes (RGB, SIZE x SIZE)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for cell, colour, shape, side in picture.items:
        x0 = (cell % GRID) * CELL + (CELL - side) // 2
        y0 = (cell // GRID) * CELL + (CELL - side) // 2
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        if shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.ellipse(box, fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def question_for(colour: str | None) -> str:
    return f"How many {colour} shapes are in the image?" if colour else "How many shapes are in the image?"


def to_row(picture: Picture, colour: str | None, task: str, split: str, idx: int) -> dict:
    n = picture.count(colour) if colour else len(picture.items)
    q = question_for(colour)
    what = f"{colour} shapes" if colour else "shapes"
    return {"id": f"{task}-{split}-{idx}", "question": q, "image": render(picture), "width": SIZE, "height": SIZE,
            "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            "answer": f"There are {n} {what}.\n#### {n}", "ground_truth": str(n), "colour": colour}


def _draw(task: str, split: str, n: int, seed: int, exclude: set[Picture]) -> tuple[list[dict], set[Picture]]:
    spec = _spec(task)
    rng = random.Random(seed * 1_000_003 + _SPLIT_SALT[split])
    rows: list[dict] = []
    pictures: set[Picture] = set()
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:  # only an n beyond the picture space (~10^9) gets here
            raise ConfigError("dataset.train_size", f"built-in task {task!r} cannot produce {n} distinct {split} "
                              "pictures", "lower dataset.train_size/test_size")
        pic = draw_picture(rng, spec)
        colour = rng.choice(spec.colours) if spec.question == "colour" else None
        if pic in exclude or (split == "test" and pic in pictures):
            continue
        pictures.add(pic)
        rows.append(to_row(pic, colour, task, split, len(rows)))
    return rows, pictures


def generate_splits(task: str = "count_shapes", train_size: int = 2000, test_size: int = 200,
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Both splits; no test picture occurs in train (train may repeat a picture)."""
    train, train_pics = _draw(task, "train", train_size, seed, exclude=set())
    test, _ = _draw(task, "test", test_size, seed, exclude=train_pics)
    return train, test


def picture_key(row: dict) -> bytes:
    """What makes two rows the same picture: the PNG bytes (rendering is deterministic)."""
    return row["image"]


def image_data_url(png: bytes) -> str:
    """``data:image/png;base64,...``: the form OpenAI-style ``image_url`` content parts carry."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def corpus(task: str = "count_shapes", n: int = 500, seed: int = 0) -> list[str]:
    """Chat-formatted text of the task for the tiny VLM's tokenizer (the vision tokens are added whole)."""
    rows, _ = _draw(task, "train", n, seed + 7, exclude=set())
    return [f"<|im_start|>user\n{r['question']}<|im_end|>\n"
            f"<|im_start|>assistant\n{r['answer']}<|im_end|>\n" for r in rows] + \
        [f"How many {c} shapes are in the image? There are {k} {c} shapes." for c in COLOURS for k in range(10)]
