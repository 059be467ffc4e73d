"""``python -m areal_cli.data.prepare gsm8k --from DIR``: a local copy (JSONL, or the hub's parquet shards
under main/) becomes the train/test JSONL that conf/dataset/gsm8k.yaml reads. Tiny fixtures, not GSM8K."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.data.prepare import main

SRC = Path(__file__).resolve().parents[3] / "src"


def rows(split: str, n: int) -> list[dict]:
    return [{"question": f"{split} q{i}: what is {i}+{i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i:,}"}
            for i in range(n)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_from_jsonl_copy(tmp_path, capsys):
    src = tmp_path / "copy"
    src.mkdir()
    for split, n in (("train", 5), ("test", 2)):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split, n)))
    (src / "LICENSE").write_text("MIT License\n")
    out = tmp_path / "data" / "gsm8k"
    assert main(["gsm8k", "--out", str(out), "--from", str(src)]) == 0
    assert read_jsonl(out / "train.jsonl") == rows("train", 5) and read_jsonl(out / "test.jsonl") == rows("test", 2)
    assert (out / "LICENSE").read_text() == "MIT License\n"
    assert capsys.readouterr().out.strip() == f"{out}/train.jsonl: 5 rows, {out}/test.jsonl: 2 rows"


def test_from_hub_layout_parquet_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    main_dir = tmp_path / "gsm8k" / "main"
    main_dir.mkdir(parents=True)
    train = rows("train", 7)
    for k, part in enumerate((train[:4], train[4:])):
        pq.write_table(pa.Table.from_pylist(part), main_dir / f"train-0000{k}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows("test", 3)), main_dir / "test-00000-of-00001.parquet")
    out = tmp_path / "out"
    # the entry point the docs name, in a subprocess
    res = subprocess.run([sys.executable, "-m", "areal_cli.data.prepare", "gsm8k", "--out", str(out), "--from",
                          str(tmp_path / "gsm8k")], check=False, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert read_jsonl(out / "train.jsonl") == train and len(read_jsonl(out / "test.jsonl")) == 3


@pytest.mark.parametrize("case,needle", [
    ("no_test", "no test file"),
    ("bad_row", "train.jsonl row 2: not a GSM8K row"),
    ("bad_json", "line 2 is not valid JSON"),
    ("bad_test_row", "test.jsonl row 1: not a GSM8K row"),
])
def test_bad_copies_are_one_line_errors(tmp_path, capsys, case, needle):
    src = tmp_path / "copy"
    src.mkdir()
    train = [json.dumps(r) for r in rows("train", 3)]
    if case == "bad_row":
        train[1] = json.dumps({"question": "q", "answer": "no marker"})
    if case == "bad_json":
        train[1] = "{oops"
    (src / "train.jsonl").write_text("\n".join(train) + "\n")
    if case != "no_test":
        test = {"question": "q"} if case == "bad_test_row" else rows("test", 1)[0]
        (src / "test.jsonl").write_text(json.dumps(test) + "\n")
    out = tmp_path / "out"
    assert main(["gsm8k", "--out", str(out), "--from", str(src)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0] and " — fix: " in err[0]
    assert not (out / "train.jsonl").exists()  # nothing half-written


# ------------------------------------------------------------------------------------------- geometry3k

def _png(colour) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buf, format="PNG")
    return buf.getvalue()


def geo_rows(split: str, n: int) -> list[dict]:
    return [{"images": [{"bytes": _png((i, 0, 0)), "path": None}], "problem": f"<image>{split} {i}: find x.",
             "answer": str(i + 1)} for i in range(n)]


def _write_geo_copy(root: Path, train: list[dict], test: list[dict]) -> Path:
    """hiyouga/geometry3k's layout: data/<split>-00000-of-00001.parquet with the datasets Image feature."""
    import datasets

    feats = datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                               "answer": datasets.Value("string")})
    (root / "data").mkdir(parents=True)
    for split, rows_ in (("train", train), ("test", test)):
        path = root / "data" / f"{split}-00000-of-00001.parquet"
        datasets.Dataset.from_list(rows_, features=feats).to_parquet(str(path))
    return root


def test_geometry3k_from_hub_layout_writes_jsonl_and_images(tmp_path, capsys):
    src = _write_geo_copy(tmp_path / "geometry3k", geo_rows("train", 3), geo_rows("test", 2))
    out = tmp_path / "data" / "geometry3k"
    capsys.readouterr()  # the fixture's own output
    assert main(["geometry3k", "--out", str(out), "--from", str(src)]) == 0
    train = read_jsonl(out / "train.jsonl")
    assert [r["answer"] for r in train] == ["1", "2", "3"] and train[2]["problem"] == "<image>train 2: find x."
    assert train[2]["images"] == ["images/train/00002_0.png"]
    assert (out / train[2]["images"][0]).read_bytes() == _png((2, 0, 0))  # the original bytes
    assert len(read_jsonl(out / "test.jsonl")) == 2
    assert capsys.readouterr().out.strip() == f"{out}/train.jsonl: 3 rows, {out}/test.jsonl: 2 rows"
    # the dataset preset's fields read it as a local image dataset (the visual checks' detection)
    from areal_cli.config.dataset import DatasetConfig
    from areal_cli.data.checks import visual_source

    cfg = DatasetConfig(train_path=str(out / "train.jsonl"), prompt_field="problem")
    assert visual_source(cfg, "train_path", cfg.train_path) == "an image dataset (column 'images')"


@pytest.mark.parametrize("case,needle", [
    ("count", "2 image(s) for 1 <image> placeholder(s)"),
    ("no_problem", "not a geometry3k row"),
])
def test_geometry3k_bad_copies(tmp_path, capsys, case, needle):
    train = geo_rows("train", 2)
    if case == "count":
        train[1]["images"] = train[1]["images"] * 2
    else:
        train[1]["problem"] = ""
    src = _write_geo_copy(tmp_path / "g", train, geo_rows("test", 1))
    out = tmp_path / "out"
    capsys.readouterr()  # the fixture's own output
    assert main(["geometry3k", "--out", str(out), "--from", str(src)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "row 2" in err[0] and " — fix: " in err[0]
    assert not (out / "train.jsonl").exists()
