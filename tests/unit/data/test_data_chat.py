"""A chat-formatted dataset (system and few-shot turns in a ``messages`` column) through the built-in
model's real tokenizer and chat template, into what the SFT loop and the workflows consume."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_cli.api.io_struct import GenerationConfig
from areal_cli.config.dataset import DatasetConfig
from areal_cli.data.datasets import load_split

SYSTEM = {"role": "system", "content": "Answer with the number only."}
SHOT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def builtin_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from areal_cli.data.builtin_model import ensure_builtin_model

    return AutoTokenizer.from_pretrained(ensure_builtin_model(tmp_path_factory.mktemp("fileroot")))


@pytest.fixture
def chat_items(tmp_path, builtin_tok):
    rows = [{"messages": [SYSTEM, *SHOT, {"role": "user", "content": f"What is {i}+3?"}],
             "answer": f"{i}+3={i + 3}\n#### {i + 3}", "id": f"c{i}"} for i in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, report = load_split(DatasetConfig(train_path=str(path), prompt_field="messages"), builtin_tok)
    assert report.kept == 4
    return items


def test_chat_items_render_every_turn(chat_items, builtin_tok):
    it = chat_items[0]
    assert builtin_tok.chat_template and it["id"] == "c0" and it["answer"] == "3"
    assert it["prompt"] == ("<|im_start|>system\nAnswer with the number only.<|im_end|>\n"
                            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                            "<|im_start|>user\nWhat is 0+3?<|im_end|>\n<|im_start|>assistant\n")
    assert builtin_tok.decode(it["prompt_ids"]) == it["prompt"]
    assert it["question"] == "What is 0+3?"


def test_sft_batches_train_on_the_solution_after_the_whole_chat(chat_items, builtin_tok):
    from areal_cli.trainer.sft import make_sft_batch

    batch = make_sft_batch(chat_items[:2], builtin_tok)
    for row, it in enumerate(chat_items[:2]):
        n_prompt = len(it["prompt_ids"])
        ids = batch["input_ids"][row].tolist()
        assert ids[:n_prompt] == it["prompt_ids"]
        assert batch["loss_mask"][row, :n_prompt].sum() == 0
        target = ids[n_prompt:int(batch["attention_mask"][row].sum())]
        assert builtin_tok.decode(target[:-1]) == it["solution"] and target[-1] == builtin_tok.eos_token_id


def test_multi_turn_continues_the_chat(chat_items, builtin_tok, fake_engine):
    """The feedback turn is appended to the item's own chat (system and few-shot turns kept), and the
    reward sees the user turns."""
    from areal_cli.rollout.workflows.multi_turn import MultiTurnWorkflow

    seen = []

    def reward(prompt, completion, answer):
        seen.append(prompt)
        return float(completion.strip() == answer)

    tok = builtin_tok
    eng = fake_engine(token_delay=0)
    eng.scripted = [tok.encode("7", add_special_tokens=False) + [tok.eos_token_id],
                    tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]]
    wf = MultiTurnWorkflow(reward, GenerationConfig(max_new_tokens=4), tok, group_size=1, max_turns=2,
                           feedback="Wrong, again.")
    traj = asyncio.run(wf.arun_episode(eng, chat_items[0]))
    assert traj.data["rewards"].tolist() == [pytest.approx(0.9)] and traj.data["n_turns"].tolist() == [2]
    text = tok.decode(traj.data["input_ids"][0].tolist())
    assert text.startswith(chat_items[0]["prompt"] + "7<|im_end|>")
    assert "<|im_start|>user\nWrong, again.<|im_end|>\n<|im_start|>assistant\n3" in text
    assert seen[0] == "What is 2+2?\nWhat is 0+3?"
