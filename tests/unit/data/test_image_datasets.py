"""Local image datasets (issue 39): JSONL rows with image paths, Parquet / saved ``datasets`` dirs / Arrow with the
HF ``Image`` feature (geometry3k's layout: an ``images`` list and ``<image>`` placeholders in ``problem``), raw
bytes; each becomes the same data item a built-in visual task gives (images as bytes, the chat's image parts where
the placeholders are), checked against the tiny Qwen2.5-VL's tokenizer. The error table, and validate-config's
cheap detection of an image dataset from its schema (the visual-task checks then apply)."""

from __future__ import annotations

import io
import json

import pytest

from areal_cli.config.dataset import DatasetConfig
from areal_cli.data.datasets import load_split
from areal_cli.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def tok(vl_tok):  # tests/conftest.py builds the tiny VLM (vl_dir) once
    return vl_tok


def png(size=(64, 64), colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def geo_rows(n=4) -> list[dict]:
    """geometry3k-shaped rows: two pictures, placed by <image> in the problem text."""
    return [{"images": [png(colour=(10 * i, 0, 0)), png((32, 48), (0, 10 * i, 0))],
             "problem": f"<image>Find x in the first figure. <image>The second is a hint. Case {i}.",
             "answer": str(3 + i)} for i in range(n)]


def image_parts(item) -> list[str]:
    return [p["type"] for p in item["messages"][-1]["content"]]


def test_jsonl_with_relative_and_absolute_paths(tmp_path, tok):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    (tmp_path / "b.png").write_bytes(png((32, 32)))
    rows = [{"question": "How many shapes?", "images": ["img/a.png"], "answer": "#### 2"},
            {"question": "<image> and <image>: how many?", "images": [str(tmp_path / "b.png"), "img/a.png"],
             "answer": "5"},
            {"question": "One image, key 'image'", "image": "b.png", "answer": "1"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, report = load_split(DatasetConfig(train_path=str(tmp_path / "d.jsonl"), max_prompt_len=128), tok)
    assert report.kept == 3 and [i["answer"] for i in items] == ["2", "5", "1"]
    assert items[0]["images"] == [png()] and image_parts(items[0]) == ["image", "text"]  # no placeholder: first
    assert items[1]["images"] == [png((32, 32)), png()]
    assert image_parts(items[1]) == ["image", "text", "image", "text"]  # where the placeholders were
    assert "<image>" not in json.dumps(items[1]["messages"])
    assert items[2]["images"] == [png((32, 32))] and "prompt_ids" not in items[2]
    # the prompt length counts each image's tokens (64x64: 16, 32x32: 4), as for the built-in tasks
    from areal_cli.models.vl_inputs import item_prompt_images

    ids = tok.encode(items[1]["prompt"], add_special_tokens=False)
    assert len(item_prompt_images(tok, items[1], ids).ids) == items[1]["prompt_len"]


def test_parquet_with_the_datasets_image_feature(tmp_path, tok):
    import datasets

    feats = datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                               "answer": datasets.Value("string")})
    datasets.Dataset.from_list(geo_rows(), features=feats).to_parquet(str(tmp_path / "g.parquet"))
    cfg = DatasetConfig(train_path=str(tmp_path / "g.parquet"), prompt_field="problem", max_prompt_len=128)
    items, report = load_split(cfg, tok)
    assert report.kept == 4 and items[1]["images"] == geo_rows()[1]["images"]
    assert image_parts(items[0]) == ["image", "text", "image", "text"] and items[3]["answer"] == "6"


def test_saved_datasets_dir_and_arrow_and_raw_bytes(tmp_path, tok):
    import datasets
    import pyarrow as pa

    feats = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                               "answer": datasets.Value("string")})
    rows = [{"image": png(), "question": f"q{i}", "answer": f"#### {i}"} for i in range(3)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows, features=feats),
                          "test": datasets.Dataset.from_list(rows[:1], features=feats)}).save_to_disk(
        str(tmp_path / "dd"))
    items, _ = load_split(DatasetConfig(train_path=str(tmp_path / "dd"), test_path=f"{tmp_path / 'dd'}:test"), tok,
                          "test")
    assert len(items) == 1 and items[0]["images"] == [png()]
    # an Arrow stream whose image column is plain binary (raw bytes), named by dataset.image_key
    table = pa.table({"pic": [png(), png((32, 32))], "question": ["a", "b"], "answer": ["1", "2"]})
    with pa.OSFile(str(tmp_path / "r.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    items, report = load_split(DatasetConfig(train_path=str(tmp_path / "r.arrow"), image_key="pic"), tok)
    assert report.kept == 2 and items[1]["images"] == [png((32, 32))]


def test_image_budgets_skip_rows_as_for_builtin_tasks(tmp_path, tok):
    (tmp_path / "big.png").write_bytes(png((128, 128)))
    (tmp_path / "small.png").write_bytes(png())
    rows = [{"question": "q", "images": ["big.png"], "answer": "1"}, {"question": "q", "images": ["small.png"],
                                                                      "answer": "2"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for knob in ({"max_image_pixels": 64 * 64}, {"max_image_tokens": 16}):
        items, report = load_split(DatasetConfig(train_path=str(tmp_path / "d.jsonl"), max_prompt_len=128, **knob), tok)
        assert [i["answer"] for i in items] == ["2"] and report.n_skipped == 1
        assert any("dataset.max_image" in r for r in report.skipped)


@pytest.mark.parametrize("row, image_key, err, words", [
    ({"question": "q", "images": ["missing.png"], "answer": "1"}, None, DataError,
     ["row 0", "cannot read image file", "missing.png", "fix:"]),
    ({"question": "q", "images": ["not_image.png"], "answer": "1"}, None, DataError,
     ["row 0", "cannot be decoded", "fix:"]),
    ({"question": "<image> <image> q", "images": ["ok.png"], "answer": "1"}, None, DataError,
     ["row 0", "2 <image> placeholder(s) for 1 image(s)", "fix:"]),
    ({"question": "q", "images": ["ok.png"], "answer": "1"}, "pictures", ConfigError,
     ["dataset.image_key", "'pictures' is not a column", "fix:"]),
])
def test_error_table(tmp_path, tok, row, image_key, err, words):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "not_image.png").write_bytes(b"this is text")
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(err) as e:
        load_split(DatasetConfig(train_path=str(tmp_path / "d.jsonl"), image_key=image_key, max_prompt_len=128), tok)
    msg = str(e.value)
    assert all(w in msg for w in words) and "\n" not in msg, msg


# ------------------------------------------------------------------------------- validate-config (schema only)

def _validate(*overrides):
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    return validate(load_config(list(overrides)))


def _write_sets(tmp_path) -> dict[str, str]:
    import datasets

    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "q", "images": ["a.png"], "answer": "1"}) + "\n")
    feats = datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                               "answer": datasets.Value("string")})
    ds = datasets.Dataset.from_list(geo_rows(2), features=feats)
    ds.to_parquet(str(tmp_path / "g.parquet"))
    ds.save_to_disk(str(tmp_path / "gdir"))
    return {"jsonl": str(tmp_path / "d.jsonl"), "parquet": str(tmp_path / "g.parquet"), "dir": str(tmp_path / "gdir")}


def test_validate_detects_image_datasets_from_their_schema(tmp_path):
    paths = _write_sets(tmp_path)
    for kind, path in paths.items():
        field = "question" if kind == "jsonl" else "problem"
        base = [f"dataset.train_path={path}", f"dataset.prompt_field={field}", "dataset.test_fraction=0.5"]
        with pytest.raises(ConfigError) as e:  # a text model: refused in one line
            _validate(*base)
        assert str(e.value).startswith("dataset.train_path") and "image dataset (column 'images')" in str(e.value)
        assert "no vision tower" in str(e.value) and "\n" not in str(e.value)
        plan = _validate("model=tiny_vl", *base)  # a VL model on the hf server plans it
        assert plan.inferences[0].backend == "hf"
        with pytest.raises(ConfigError, match="^workflow.name.*does not send"):
            _validate("model=tiny_vl", *base, "workflow=online", "rollout.group_size=1")
    with pytest.raises(ConfigError, match="^dataset.image_key: 'pic' is not a column"):
        _validate("model=tiny_vl", f"dataset.train_path={paths['jsonl']}", "dataset.image_key=pic")


@pytest.mark.parametrize("alloc, backend", [("gpu8_sglang_fsdp", "sglang"), ("vllm:d4+fsdp:d4", "vllm")])
def test_validate_image_dataset_servers(tmp_path, alloc, backend):
    path = _write_sets(tmp_path)["parquet"]
    args = ["model=qwen2_5_vl_3b", "cluster=gpu_1x8", f"allocation_mode={alloc}", f"dataset.train_path={path}",
            "dataset.prompt_field=problem", "dataset.test_fraction=0.5"]
    assert _validate(*args).inferences[0].backend == backend


def test_image_detection_reads_no_image_and_imports_no_torch(tmp_path):
    """validate-config on image datasets (Parquet with the Image feature, a saved dir, JSONL paths to files that
    are not even images) stays cheap: the schema or first rows only; no torch, transformers, datasets or PIL."""
    import subprocess
    import sys
    from pathlib import Path

    paths = _write_sets(tmp_path)
    (tmp_path / "a.png").write_bytes(b"not read by validate-config")
    src = Path(__file__).resolve().parents[3] / "src"
    code = ("import sys\n"
            "from areal_cli.plan.compose import load_config\n"
            "from areal_cli.plan.validate import validate\n"
            f"for p, f in (({paths['parquet']!r}, 'problem'), ({paths['dir']!r}, 'problem'), ({paths['jsonl']!r}, "
            "'question')):\n"
            "    validate(load_config(['model=tiny_vl', 'dataset.train_path=' + p, 'dataset.prompt_field=' + f, "
            "'dataset.test_fraction=0.5']))\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'PIL') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
