"""Write GSM8K as the jsonl files the examples read: data/gsm8k/train.jsonl and data/gsm8k/test.jsonl.

Each row keeps GSM8K's own fields: ``question``, and ``answer`` (the worked solution ending in
``#### <number>``), which is the ``dataset`` group's default shape (``dataset.prompt_field=question``,
``dataset.answer_field=answer``; the number after ``####`` becomes the reference). Needs the
``datasets`` package and the Hugging Face Hub (``openai/gsm8k``, config ``main``), or ``--source`` a
local copy saved with ``save_to_disk``. Run it once, from the directory you run ``areal train`` in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_split(rows, path: Path, split: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": f"gsm8k-{split}-{i}", "question": row["question"],
                                "answer": row["answer"]}) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/gsm8k", help="output folder (default: data/gsm8k)")
    ap.add_argument("--source", default="openai/gsm8k",
                    help="hub id, or a folder written by DatasetDict.save_to_disk (default: openai/gsm8k)")
    args = ap.parse_args(argv)
    import datasets

    if Path(args.source).is_dir():
        ds = datasets.load_from_disk(args.source)
    else:
        ds = datasets.load_dataset(args.source, "main")
    for split in ("train", "test"):
        path = Path(args.out) / f"{split}.jsonl"
        print(f"{path}: {write_split(ds[split], path, split)} rows")


if __name__ == "__main__":
    main()
