"""Reading a dataset path's columns cheaply (data/sources.py): every format, chat detection, the
``DIR:split`` form, and the one-line errors for paths and unreadable files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_cli.data.sources import (
    PEEK_BYTES,
    first_json_records,
    parse_source,
    peek_columns,
)
from areal_cli.errors import ConfigError, DataError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
ROWS = [{"messages": CHAT, "question": "1+1?", "answer": "#### 2", "n": 2, "tags": ["a"]},
        {"messages": CHAT, "question": "2+2?", "answer": "#### 4", "n": 4, "tags": []}]


def cols(path, key="dataset.train_path"):
    return peek_columns(parse_source(str(path), key))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same rows as parquet, arrow, a saved Dataset and a saved DatasetDict (train/test)."""
    import datasets

    d = tmp_path_factory.mktemp("saved")
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(d / "rows.parquet"))
    ds.save_to_disk(str(d / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(d / "dd"))
    arrow = next((d / "single").glob("*.arrow"))
    (d / "rows.arrow").write_bytes(arrow.read_bytes())
    return d


def test_jsonl_json_list_and_csv(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    c = cols(p)
    assert c.names == ["messages", "question", "answer", "n", "tags"]
    assert c.kinds == {"messages": "chat", "question": "text", "answer": "text", "n": "number", "tags": "list"}
    assert c.where == "its first 2 rows"
    lst = tmp_path / "d.json"
    lst.write_text(json.dumps(ROWS, indent=2))
    assert cols(lst).kinds == c.kinds
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,target\nhi,1\n")
    c = cols(csv)
    assert c.names == ["prompt", "target"] and c.kind("prompt") == "unknown" and c.where == "its header"


def test_parquet_arrow_and_saved_dirs_from_their_schema(saved):
    want = {"messages": "chat", "question": "text", "answer": "text", "n": "number", "tags": "list"}
    for name in ("rows.parquet", "rows.arrow", "single", "dd"):
        c = cols(saved / name)
        assert c.names == list(want) and c.kinds == want, name
    assert cols(saved / "dd").splits == ["train", "test"] and "'train' split" in cols(saved / "dd").where
    assert "'test' split" in cols(f"{saved / 'dd'}:test").where


def test_split_names(saved):
    with pytest.raises(ConfigError) as e:
        cols(f"{saved / 'dd'}:tset", "dataset.test_path")
    assert e.value.path == "dataset.test_path" and "splits: train, test" in e.value.reason
    assert "did you mean 'test'?" in e.value.hint
    with pytest.raises(ConfigError, match="single saved Dataset"):
        cols(f"{saved / 'single'}:test")
    with pytest.raises(ConfigError, match="is a file"):
        cols(f"{saved / 'rows.parquet'}:test")
    src = parse_source(f"{saved / 'dd'}:test", "dataset.test_path")
    assert (src.path, src.split) == (saved / "dd", "test")
    # A path that exists as written is never split at its colon.
    odd = saved / "a:b.jsonl"
    odd.write_text(json.dumps(ROWS[0]) + "\n")
    assert parse_source(str(odd), "k").split is None and "question" in cols(odd).names


def test_path_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        cols(tmp_path / "missing.jsonl")
    assert e.value.path == "dataset.train_path" and "does not exist" in e.value.reason
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ConfigError, match="unsupported dataset file type '.txt'"):
        cols(tmp_path / "x.txt")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="not a saved datasets dir"):
        cols(tmp_path / "plain")


def test_unreadable_contents_are_data_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"^dataset.train_path: .*line 2 is not valid JSON"):
        cols(bad)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        cols(tmp_path / "empty.jsonl")
    (tmp_path / "nums.jsonl").write_text("1\n2\n")
    with pytest.raises(DataError, match="not a JSON object"):
        cols(tmp_path / "nums.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read"):
        cols(tmp_path / "broken.parquet")


def test_only_the_start_of_a_big_file_is_read(tmp_path):
    row = json.dumps({"question": "q" * 1000, "answer": "#### 1"}) + "\n"
    big = tmp_path / "big.jsonl"
    big.write_text(row * (2 * PEEK_BYTES // len(row)) + "{broken\n")  # the break lies past the window
    c = cols(big)
    assert c.names == ["question", "answer"] and c.where == "its first 50 rows"
    # A window that cuts the last record is not an error; a bad record inside it is.
    text = row * 3
    assert len(first_json_records(text[:-10], 10, cut=True)) == 2
    with pytest.raises(ValueError, match="line 3"):
        first_json_records(text[:-10], 10, cut=False)


def test_a_saved_dir_is_read_from_its_info_alone(saved, tmp_path):
    """The columns come from dataset_info.json: the arrow data itself is never opened."""
    import shutil

    d = tmp_path / "dd"
    shutil.copytree(saved / "dd", d)
    for f in Path(d).rglob("*.arrow"):
        f.write_bytes(b"")
    assert cols(f"{d}:test").kind("messages") == "chat"
