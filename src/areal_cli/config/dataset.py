"""``dataset`` group: where prompts and reference answers come from."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.ranges import ranged


@dataclass
class DatasetConfig:
    # "builtin:<task>" (generated deterministically) or a local path: jsonl / json / parquet / csv / arrow,
    # or a saved datasets dir ("DIR:split" picks a split of a saved DatasetDict). docs/data.md.
    name: str = "arith"
    train_path: str = "builtin:arith"
    # None: the built-in test split; for local data dataset.test_fraction of the train file, or no eval
    test_path: str | None = None
    # a text column (one user turn) or a chat column (a list of {role, content} messages ending in a user turn)
    prompt_field: str = "question"
    answer_field: str = "answer"  # GSM8K-style "... #### 42" answers are parsed
    # algo=rm: the preference pair's sides, each a text or a chat (data/preferences.py; docs/rewards.md)
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # local data without test_path: hold out this share of the train file's rows (a fixed, seeded draw)
    test_fraction: float = ranged(0.0, ge=0.0, lt=1.0, why="0 holds nothing out")
    use_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_len: int = ranged(256, ge=1)  # with images: each image counts as its image tokens
    # Image budgets of a visual dataset (docs/vision.md), also the hf server's --max-image-pixels /
    # --max-image-tokens: the decoded width x height of one image (a larger one is skipped), and the image tokens
    # of one prompt (all its images after the processor's resize). null: the server's defaults.
    # The image column of a local visual dataset (data/image_rows.py: paths, datasets.Image structs or bytes;
    # "<image>" in the prompt text places each image). null: "images", else "image", when the file has one.
    image_key: str | None = None
    max_image_pixels: int | None = ranged(None, ge=1, why="null: the hf server's default (4096 x 4096)")
    max_image_tokens: int | None = ranged(None, ge=1, why="null: no cap but max_prompt_len")
    shuffle: bool = True
    drop_last: bool = True
    train_size: int = ranged(20000, ge=1)  # builtin only
    test_size: int = ranged(200, ge=0)  # builtin only
    # cap on evaluated test items
    eval_size: int | None = ranged(None, ge=0, why="null evaluates every test item")
    # The built-in task's rows (its train and test splits) and the test_fraction draw; null: the experiment
    # seed. Fix it to vary the run seed (sampling, prompt order) over the same data, e.g. in a seed study.
    seed: int | None = ranged(None, ge=0, le=2**32 - 1, why="null uses the experiment seed")
