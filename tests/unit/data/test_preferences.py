"""Preference pairs for algo=rm: text and chat rows from JSONL / Parquet / a saved datasets dir, the built-in
pairs, and the one-line error for a row missing a side."""

from __future__ import annotations

import json

import pytest

from areal_cli.config.dataset import DatasetConfig
from areal_cli.data.preferences import build_pairs, builtin_pair_rows, load_pairs
from areal_cli.errors import DataError

CHAT_CHOSEN = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
CHAT_REJECTED = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from areal_cli.data.builtin_model import ensure_builtin_model

    return AutoTokenizer.from_pretrained(ensure_builtin_model(tmp_path_factory.mktemp("fileroot")))


def _rows():
    return [{"chosen": "2+2=4", "rejected": "2+2=5", "id": "a"},
            {"prompt": "What is 3+3?", "chosen": "6", "rejected": "7"},
            {"chosen": CHAT_CHOSEN, "rejected": CHAT_REJECTED},
            {"prompt": [{"role": "user", "content": "What is 1+1?"}],
             "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"}]


def test_text_and_chat_rows(tok):
    pairs, report = build_pairs(_rows(), tok, source="mem")
    assert report.kept == 4 and [p["id"] for p in pairs] == ["a", "row-1", "row-2", "row-3"]
    dec = [(tok.decode(p["chosen_ids"]), tok.decode(p["rejected_ids"])) for p in pairs]
    assert dec[0] == ("2+2=4", "2+2=5")
    # a text prompt with text sides goes through the chat template: user turn, then the side as the answer
    assert dec[1][0] == tok.apply_chat_template([{"role": "user", "content": "What is 3+3?"},
                                                 {"role": "assistant", "content": "6"}], tokenize=False)
    assert dec[2][0] == tok.apply_chat_template(CHAT_CHOSEN, tokenize=False)
    assert dec[3][1].endswith("3<|im_end|>\n") and "What is 1+1?" in dec[3][1]


@pytest.mark.parametrize("row,side", [({"chosen": "x"}, "rejected"), ({"rejected": "x"}, "chosen"),
                                       ({"chosen": "", "rejected": "x"}, "chosen"),
                                       ({"chosen": "x", "rejected": [{"role": "bot", "content": 1}]}, "rejected")])
def test_a_row_missing_a_side_is_one_line_naming_row_file_and_side(tok, row, side):
    with pytest.raises(DataError) as e:
        build_pairs([{"chosen": "a", "rejected": "b"}, row], tok, source="prefs.jsonl")
    msg = str(e.value)
    assert "\n" not in msg and "prefs.jsonl: row 1:" in msg and f"{side} side" in msg and "fix:" in msg


def _write_all(tmp_path, rows):
    import datasets

    jl = tmp_path / "p.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    pq = tmp_path / "p.parquet"
    ds.to_parquet(str(pq))
    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved))
    return [jl, pq, saved]


def test_jsonl_parquet_and_saved_dir_give_the_same_pairs(tok, tmp_path):
    rows = [{"question": f"What is {i}+1?", "good": f"{i + 1}", "bad": f"{i + 2}"} for i in range(6)]
    got = []
    for path in _write_all(tmp_path, rows):
        cfg = DatasetConfig(train_path=str(path), chosen_field="good", rejected_field="bad", test_fraction=0.34)
        train, _ = load_pairs(cfg, tok, "train", seed=0)
        test, _ = load_pairs(cfg, tok, "test", seed=0)
        assert len(train) == 4 and len(test) == 2
        got.append([(p["chosen_ids"], p["rejected_ids"]) for p in train + test])
    assert got[0] == got[1] == got[2]


def test_missing_side_in_a_file_names_the_file(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"chosen": "a", "rejected": "b"}) + "\n" + json.dumps({"chosen": "a"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1: the preference pair's rejected side is missing"):
        load_pairs(DatasetConfig(train_path=str(path)), tok, "train", seed=0)


def test_builtin_pairs_are_seeded_and_wrong_by_construction():
    a = builtin_pair_rows("arith", "train", 50, seed=0, train_size=50)
    assert a == builtin_pair_rows("arith", "train", 50, seed=0, train_size=50)
    for r in a:
        right = int(r["chosen"].rsplit("####", 1)[1])
        wrong = int(r["rejected"].rsplit("####", 1)[1])
        assert wrong != right and wrong >= 0
        assert r["rejected"].split("\n")[0].rsplit("=", 1)[0] == r["chosen"].split("\n")[0].rsplit("=", 1)[0]
    test = builtin_pair_rows("arith", "test", 20, seed=0, train_size=50)
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in a}


def test_builtin_pairs_through_the_dataset_group(tok):
    cfg = DatasetConfig(train_size=40, test_size=10)
    train, _ = load_pairs(cfg, tok, "train", seed=0)
    test, _ = load_pairs(cfg, tok, "test", seed=0)
    assert len(train) == 40 and len(test) == 10 and train[0]["chosen_ids"] != train[0]["rejected_ids"]
