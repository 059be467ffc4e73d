"""Loading datasets from local files and the built-in task into data items."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from areal_cli.config.dataset import DatasetConfig
from areal_cli.data.datasets import build_items, check_dataset_paths, extract_answer, load_split
from areal_cli.errors import ConfigError, DataError

GSM8K = Path("/work/shared/data/gsm8k")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    # Only a tokenizer is needed: train the same ChatML BPE the tiny models use, without a model.
    from transformers import AutoTokenizer

    from areal_cli.models.tiny import default_corpus, train_tokenizer

    d = train_tokenizer(tmp_path_factory.mktemp("tok"), default_corpus(500))
    return AutoTokenizer.from_pretrained(d)


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_extract_answer():
    assert extract_answer("48/2 = 24\n#### 72") == "72"
    assert extract_answer("x #### 1,000") == "1000"
    assert extract_answer("#### $5") == "5"
    assert extract_answer("a #### 1\n#### 2") == "2"
    assert extract_answer(" 42 ") == "42"
    assert extract_answer(7) == "7" and extract_answer(2.0) == "2"
    for bad in (None, "", "   ", "####  ", True, ["1"]):
        assert extract_answer(bad) is None


@pytest.mark.skipif(not (GSM8K / "test.jsonl").exists(), reason="GSM8K not on this machine")
def test_real_gsm8k_parses(tok):
    cfg = DatasetConfig(train_path=str(GSM8K / "train.jsonl"), test_path=str(GSM8K / "test.jsonl"),
                        max_prompt_len=100_000)
    items, report = load_split(cfg, tok, "test")
    raw = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines() if line.strip()]
    assert report.total == len(raw) == report.kept == len(items)
    for it, row in zip(items, raw):
        assert it["answer"] == row["answer"].split("####")[-1].strip().replace(",", "")
        float(it["answer"])  # every GSM8K reference is a number
        assert it["question"] == row["question"] and it["solution"] == row["answer"]
    first = items[0]
    assert first["prompt"] == tok.apply_chat_template(first["messages"], add_generation_prompt=True,
                                                      tokenize=False)
    assert first["prompt"].endswith("<|im_start|>assistant\n")
    assert tok.decode(first["prompt_ids"]) == first["prompt"]


def test_malformed_rows_are_skipped_counted_and_reported(tmp_path, tok, caplog):
    rows = [{"question": "What is 1+1?", "answer": "1+1=2\n#### 2"},
            {"question": "", "answer": "#### 3"},
            {"answer": "#### 4"},
            {"question": "Q5", "answer": None},
            {"question": "Q6", "answer": "no marker but text"},
            {"question": "Q7", "answer": 7},
            {"question": 8, "answer": "#### 8"},
            {"question": "Q9", "answer": "#### "}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level("WARNING"):
        items, report = load_split(DatasetConfig(train_path=path), tok, "train")
    assert [it["answer"] for it in items] == ["2", "no marker but text", "7"]
    assert report.total == 8 and report.kept == 3 and report.n_skipped == 5
    assert report.skipped == {"missing/empty 'question'": 3, "missing/unparseable 'answer'": 2}
    assert report.first_bad_rows == [1, 2, 3, 6, 7]
    assert "skipped 5" in caplog.text
    # No test_path with a local train file → no held-out split.
    assert load_split(DatasetConfig(train_path=path), tok, "test") is None


def test_too_long_prompts_are_skipped(tmp_path, tok):
    rows = [{"question": "short", "answer": "1"}, {"question": "word " * 300, "answer": "2"}]
    items, report = load_split(DatasetConfig(train_path=_write_jsonl(tmp_path / "d.jsonl", rows),
                                             max_prompt_len=64), tok)
    assert len(items) == 1 and report.skipped == {"prompt longer than dataset.max_prompt_len": 1}


def test_field_mapping_parquet_and_saved_dir(tmp_path, tok):
    import datasets

    rows = [{"prompt": f"Add {i} and {i}.", "target": str(2 * i), "extra": i} for i in range(6)]
    ds = datasets.Dataset.from_list(rows)
    pq = tmp_path / "d.parquet"
    ds.to_parquet(str(pq))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(saved))
    for path in (str(pq), str(saved)):
        cfg = DatasetConfig(train_path=path, prompt_field="prompt", answer_field="target",
                            system_prompt="Be brief.")
        items, report = load_split(cfg, tok)
        assert report.kept == 6
        assert [it["answer"] for it in items] == [str(2 * i) for i in range(6)]
        assert items[0]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert items[0]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_no_chat_template_uses_raw_question(tok):
    items, _ = build_items([{"question": "Raw q", "answer": "#### 1"}], tok, use_chat_template=False)
    assert items[0]["prompt"] == "Raw q"


def test_wrong_field_mapping_is_an_error(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "a": "1"}] * 4)
    with pytest.raises(DataError, match="^dataset.prompt_field"):
        load_split(DatasetConfig(train_path=path), tok)


def test_missing_file_named_before_launch(tmp_path):
    cfg = DatasetConfig(train_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError) as e:
        check_dataset_paths(cfg)
    assert str(e.value).startswith("dataset.train_path:") and "nope.jsonl" in str(e.value)
    (tmp_path / "ok.jsonl").write_text("")
    with pytest.raises(ConfigError, match="dataset.test_path"):
        check_dataset_paths(DatasetConfig(train_path=str(tmp_path / "ok.jsonl"),
                                          test_path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="unsupported"):
        (tmp_path / "x.txt").write_text("hi")
        check_dataset_paths(DatasetConfig(train_path=str(tmp_path / "x.txt")))
    with pytest.raises(ConfigError) as ce:
        check_dataset_paths(DatasetConfig(train_path="builtin:nope"))
    assert ce.value.path == "dataset.train_path"
    check_dataset_paths(DatasetConfig())  # the default is fine


def test_missing_file_in_load_split_too(tmp_path, tok):
    with pytest.raises(ConfigError, match="^dataset.train_path"):
        load_split(DatasetConfig(train_path=str(tmp_path / "gone.parquet")), tok)


def test_builtin_splits(tok):
    cfg = DatasetConfig(train_size=300, test_size=40, eval_size=25)
    train, rep = load_split(cfg, tok, "train", seed=2)
    test, _ = load_split(cfg, tok, "test", seed=2)
    assert rep.kept == 300 and len(test) == 25
    assert not {i["question"] for i in train} & {i["question"] for i in test}
    it = train[0]
    assert set(it) >= {"id", "question", "messages", "prompt", "prompt_ids", "answer", "solution"}
    assert it["solution"].endswith("#### " + it["answer"])
    assert it["prompt_ids"] == tok(it["prompt"], add_special_tokens=False)["input_ids"]
    again, _ = load_split(cfg, tok, "train", seed=2)
    assert [i["prompt_ids"] for i in again] == [i["prompt_ids"] for i in train]
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    # another run seed draws other rows; dataset.seed fixes them whatever the run seed
    other, _ = load_split(cfg, tok, "train", seed=3)
    assert [i["question"] for i in other] != [i["question"] for i in train]
    fixed = dataclasses.replace(cfg, seed=2)
    for run_seed in (3, 7):
        rows, _ = load_split(fixed, tok, "train", seed=run_seed)
        assert [i["question"] for i in rows] == [i["question"] for i in train]
        held, _ = load_split(fixed, tok, "test", seed=run_seed)
        assert [i["question"] for i in held] == [i["question"] for i in test]


CHAT = [{"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "What is 3+5?"}]


def test_chat_prompts_keep_system_and_few_shot_turns(tmp_path, tok, caplog):
    rows = [{"messages": CHAT, "answer": "#### 8"},
            {"messages": CHAT[1:2], "answer": "4"},  # no system turn: dataset.system_prompt is added
            {"messages": CHAT[:3], "answer": "4"},  # ends with the assistant: nothing to answer
            {"messages": [], "answer": "1"},
            {"messages": [{"role": "narrator", "content": "x"}], "answer": "1"},
            {"messages": "a plain text prompt in the same column", "answer": "2"}]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = DatasetConfig(train_path=path, prompt_field="messages", system_prompt="Be brief.")
    with caplog.at_level("WARNING"):
        items, report = load_split(cfg, tok)
    assert report.skipped == {"chat not ending in a user turn in 'messages'": 1, "empty chat in 'messages'": 1,
                              "malformed chat message in 'messages'": 1}
    first, second, text = items
    assert first["messages"] == CHAT  # its own system turn wins over dataset.system_prompt
    assert first["prompt"] == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert first["prompt"].count("<|im_start|>user") == 2 and "Be brief." not in first["prompt"]
    assert first["question"] == "What is 3+5?" and first["answer"] == "8"
    assert tok.decode(first["prompt_ids"]) == first["prompt"]
    assert second["messages"][0] == {"role": "system", "content": "Be brief."}
    assert text["messages"][-1]["content"].startswith("a plain text prompt")
    with pytest.raises(DataError, match="^dataset.prompt_field: .*holds chats"):
        load_split(DatasetConfig(train_path=path, prompt_field="messages", use_chat_template=False), tok)


def test_chats_from_parquet_and_the_legacy_dict_of_lists(tmp_path, tok):
    import datasets

    from areal_cli.data.datasets import as_chat

    datasets.Dataset.from_list([{"messages": CHAT, "answer": "8"}]).to_parquet(str(tmp_path / "c.parquet"))
    items, _ = load_split(DatasetConfig(train_path=str(tmp_path / "c.parquet"), prompt_field="messages"), tok)
    assert items[0]["messages"] == CHAT
    legacy = {"role": [m["role"] for m in CHAT], "content": [m["content"] for m in CHAT]}
    assert as_chat(legacy) == CHAT
    assert as_chat([{"role": "user", "content": "x", "name": None}]) == [{"role": "user", "content": "x"}]


def test_test_fraction_holds_out_a_fixed_seeded_share(tmp_path, tok):
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(40)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DatasetConfig(train_path=path, test_fraction=0.25, eval_size=8)
    train, _ = load_split(cfg, tok, "train", seed=1)
    test, report = load_split(cfg, tok, "test", seed=1)
    assert len(train) == 30 and report.kept == 10 and len(test) == 8  # eval_size caps the test items
    full_test, _ = load_split(dataclasses.replace(cfg, eval_size=None), tok, "test", seed=1)
    ids = {it["id"] for it in train} | {it["id"] for it in full_test}
    assert len(ids) == 40 and all(i.startswith("row-") for i in ids)  # disjoint, every row once
    assert {it["question"] for it in full_test} == {rows[int(i[4:])]["question"] for i in
                                                     {it["id"] for it in full_test}}
    again, _ = load_split(cfg, tok, "test", seed=1)
    assert [it["id"] for it in again] == [it["id"] for it in test]
    other, _ = load_split(dataclasses.replace(cfg, eval_size=None), tok, "test", seed=2)
    assert {it["id"] for it in other} != {it["id"] for it in full_test}  # the run seed draws it...
    fixed = dataclasses.replace(cfg, eval_size=None, seed=5)  # ...unless dataset.seed fixes it
    assert ({it["id"] for it in load_split(fixed, tok, "test", seed=1)[0]}
            == {it["id"] for it in load_split(fixed, tok, "test", seed=2)[0]})
    with pytest.raises(DataError, match="^dataset.test_fraction"):
        load_split(DatasetConfig(train_path=_write_jsonl(tmp_path / "one.jsonl", rows[:1]), test_fraction=0.5),
                   tok, "test")


def test_a_split_of_a_saved_datasetdict(tmp_path, tok):
    import datasets

    def ds(lo, hi):
        return datasets.Dataset.from_list([{"question": f"q{i}", "answer": str(i)} for i in range(lo, hi)])

    d = tmp_path / "dd"
    datasets.DatasetDict({"validation": ds(0, 2), "train": ds(2, 7), "test": ds(7, 9)}).save_to_disk(str(d))
    cfg = DatasetConfig(train_path=str(d), test_path=f"{d}:test")
    train, _ = load_split(cfg, tok, "train")
    test, _ = load_split(cfg, tok, "test")
    assert [it["answer"] for it in train] == ["2", "3", "4", "5", "6"]  # no split named: train
    assert [it["answer"] for it in test] == ["7", "8"]
    val, _ = load_split(DatasetConfig(train_path=f"{d}:validation"), tok, "train")
    assert [it["answer"] for it in val] == ["0", "1"]
    with pytest.raises(ConfigError, match="has no split 'tset'"):
        load_split(DatasetConfig(train_path=str(d), test_path=f"{d}:tset"), tok, "test")
