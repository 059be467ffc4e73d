"""``dataset`` group: where prompts and reference answers come from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DatasetConfig:
    # "builtin:<task>" (generated deterministically) or a local path (jsonl / parquet / saved dir)
    name: str = "arith"
    train_path: str = "builtin:arith"
    test_path: str | None = None  # None → the builtin test split, or no eval for local data
    prompt_field: str = "question"
    answer_field: str = "answer"  # GSM8K-style "... #### 42" answers are parsed
    use_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_len: int = 256
    shuffle: bool = True
    drop_last: bool = True
    train_size: int = 20000  # builtin only
    test_size: int = 200  # builtin only
    eval_size: int | None = None  # cap on evaluated test items
