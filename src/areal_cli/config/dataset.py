"""``dataset`` group: where prompts and reference answers come from."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.ranges import ranged


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
    max_prompt_len: int = ranged(256, ge=1)
    shuffle: bool = True
    drop_last: bool = True
    train_size: int = ranged(20000, ge=1)  # builtin only
    test_size: int = ranged(200, ge=0)  # builtin only
    # cap on evaluated test items
    eval_size: int | None = ranged(None, ge=0, why="null evaluates every test item")
    # The built-in task's rows (its train and test splits); null: the experiment seed. Fix it to vary the run
    # seed (sampling, prompt order) over the same data, e.g. in a seed study.
    seed: int | None = ranged(None, ge=0, le=2**32 - 1, why="null uses the experiment seed")
