"""The built-in visual task (count the shapes of one colour): seeded, held-out pictures, answers that match the
pixels, scored by the numeric and math rewards, and refused as a training dataset until images reach the
engines."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from areal_cli.data import builtin_vision as bv
from areal_cli.errors import ConfigError


def _colour_of(px: tuple[int, int, int]) -> str | None:
    for name, rgb in bv.COLOURS.items():
        if px == rgb:
            return name
    return None


def _count_from_pixels(png: bytes, colour: str) -> int:
    """Count the cells whose centre pixel is ``colour``: what a reader of the picture would answer."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.size == (bv.SIZE, bv.SIZE)
    centres = [(c * bv.CELL + bv.CELL // 2, r * bv.CELL + bv.CELL // 2) for r in range(bv.GRID) for c in range(bv.GRID)]
    return sum(_colour_of(img.getpixel(xy)) == colour for xy in centres)


def test_rows_are_seeded_and_reproducible():
    a_train, a_test = bv.generate_splits("count_shapes", 40, 20, seed=3)
    b_train, b_test = bv.generate_splits("count_shapes", 40, 20, seed=3)
    assert a_train == b_train and a_test == b_test  # PNG bytes included
    c_train, _ = bv.generate_splits("count_shapes", 40, 20, seed=4)
    assert [r["image"] for r in c_train] != [r["image"] for r in a_train]
    assert [r["id"] for r in a_train] == [f"count_shapes-train-{i}" for i in range(40)]


def test_test_pictures_never_occur_in_train():
    train, test = bv.generate_splits("count_shapes", 3000, 300, seed=0)
    train_pics = {bv.picture_key(r) for r in train}
    test_pics = [bv.picture_key(r) for r in test]
    assert len(test) == 300 and len(set(test_pics)) == 300
    assert not train_pics & set(test_pics)
    # the streams differ: the test split is not a filtered copy of train's
    assert [r["question"] for r in test[:20]] != [r["question"] for r in train[:20]]


def test_answers_match_the_pixels_and_cover_the_range():
    train, _ = bv.generate_splits("count_shapes", 200, 1, seed=1)
    counts = set()
    for r in train:
        n = _count_from_pixels(r["image"], r["colour"])
        assert r["ground_truth"] == str(n)
        assert r["answer"].endswith(f"#### {n}") and r["colour"] in r["question"]
        assert r["messages"][0]["content"][0] == {"type": "image"}
        assert r["messages"][0]["content"][1]["text"] == r["question"]
        counts.add(n)
    assert {0, 1, 2, 3} <= counts  # zero included: a colour may be absent
    assert bv.image_data_url(train[0]["image"]).startswith("data:image/png;base64,iVBOR")


@pytest.mark.parametrize("reward", ["numeric", "math"])
def test_reward_scores_right_and_wrong_answers(reward):
    from areal_cli.rewards.registry import get_reward_fn

    fn = get_reward_fn(reward)
    row = bv.generate_splits("count_shapes", 5, 1, seed=2)[0][0]
    n = int(row["ground_truth"])
    assert fn(row["question"], f"I count them.\n#### {n}", row["answer"]).correct is True
    assert fn(row["question"], f"I count them.\n#### {n + 1}", row["answer"]).correct is False


def test_unknown_task_and_training_use_are_config_errors():
    from areal_cli.config.dataset import DatasetConfig
    from areal_cli.data.checks import check_builtin, check_dataset_paths

    with pytest.raises(ConfigError, match="unknown built-in visual task"):
        bv.generate_splits("count_circles", 2, 1)
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    assert check_dataset_paths(DatasetConfig(train_path="builtin:count_shapes")) == []  # trainable now
    with pytest.raises(ConfigError, match="visual task.*docs/vision.md") as e:  # but not by a text model
        validate(load_config(["dataset.train_path=builtin:count_shapes"]))
    assert "dataset.train_path" in str(e.value) and "\n" not in str(e.value)
    assert check_builtin("train_path", "builtin:arith") is True


def _shapes_from_pixels(png: bytes) -> int:
    img = Image.open(io.BytesIO(png)).convert("RGB")
    centres = [(c * bv.CELL + bv.CELL // 2, r * bv.CELL + bv.CELL // 2)
               for r in range(bv.GRID) for c in range(bv.GRID)]
    return sum(_colour_of(img.getpixel(xy)) is not None for xy in centres)


def test_count_all_asks_for_every_shape_and_holds_out_its_pictures():
    """The vision default (docs/vision.md says why not count_shapes): how many shapes, 3 to 12."""
    assert bv.DEFAULT_TASK == "count_all"
    train, test = bv.generate_splits("count_all", 300, 100, seed=0)
    assert not {bv.picture_key(r) for r in train} & {bv.picture_key(r) for r in test}
    counts = set()
    for r in train + test:
        n = _shapes_from_pixels(r["image"])
        assert r["ground_truth"] == str(n) and r["answer"] == f"There are {n} shapes.\n#### {n}"
        assert r["question"] == "How many shapes are in the image?" and r["colour"] is None
        counts.add(n)
    assert counts == set(range(3, 13))
