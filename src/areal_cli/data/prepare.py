"""Prepare a public dataset as the JSONL files a ``dataset`` preset names.

::

    python -m areal_cli.data.prepare gsm8k --out data/gsm8k             # online: openai/gsm8k (config main)
    python -m areal_cli.data.prepare gsm8k --out data/gsm8k --from DIR  # offline: a local copy
    python -m areal_cli.data.prepare geometry3k --out data/geometry3k   # online: hiyouga/geometry3k

``--from DIR`` reads ``train``/``test`` files of DIR (or of DIR/main or DIR/data, the hub repositories'
layouts): ``train.jsonl``, ``train.json``, ``train.parquet`` or parquet shards ``train-00000-of-00001.parquet``.

geometry3k (hiyouga/geometry3k: 2101 train / 601 test geometry problems, each with its diagram; the
``problem`` text holds one ``<image>`` placeholder per image) becomes ``<out>/{train,test}.jsonl`` rows
``{"problem", "images": ["images/<split>/<row>_<k>.png"], "answer"}`` with the images written beside them
(their original bytes; paths relative to the JSONL's directory: data/image_rows.py reads them), which
``conf/dataset/geometry3k.yaml`` names. Every row is checked the same way (a problem, an answer, at least one
image, as many ``<image>`` placeholders as images).
The output is ``<out>/train.jsonl`` and ``<out>/test.jsonl`` with one ``{"question", "answer"}`` object
per line (``conf/dataset/gsm8k.yaml`` reads them), written atomically; a LICENSE next to the source
files is copied along. Every row is checked (a question, and an answer ending in ``#### n``): a row that
is not is a ``DataError`` naming the file and row, since a silently short GSM8K would skew every
comparison made with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from areal_cli.errors import ArealError, DataError

SPLITS = ("train", "test")


def find_split_files(src: Path, split: str) -> list[Path]:
    """The files of ``split`` under ``src`` or ``src/main``: one jsonl/json/parquet file, or parquet shards."""
    for d in (src, src / "main", src / "data"):
        for name in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet"):
            if (d / name).is_file():
                return [d / name]
        shards = sorted(d.glob(f"{split}-*.parquet"))
        if shards:
            return shards
    raise DataError(f"--from {src}: no {split} file (looked for {split}.jsonl, {split}.json, {split}.parquet "
                    f"and {split}-*.parquet shards in {src}, {src / 'main'} and {src / 'data'}) — fix: point --from at the "
                    "directory holding the downloaded files")


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(str(path)).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n} is not valid JSON ({e.msg}) — fix: re-download the file") from e
    return rows


def gsm8k_row(row: object, where: str) -> dict:
    """``{"question", "answer"}`` of one GSM8K row, checked."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: not a JSON object — fix: use the original GSM8K files")
    q, a = row.get("question"), row.get("answer")
    if not isinstance(q, str) or not q.strip() or not isinstance(a, str) or "####" not in a:
        raise DataError(f"{where}: not a GSM8K row (needs a 'question' and an 'answer' ending in '#### n'; "
                        f"keys: {sorted(row)}) — fix: use the original GSM8K files (config 'main')")
    return {"question": q, "answer": a}


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    os.replace(tmp, path)


def _hub_splits(repo: str, config: str | None) -> dict[str, list[dict]]:
    try:
        import datasets

        ds = datasets.load_dataset(repo, config)
        return {split: ds[split].to_list() for split in SPLITS}
    except Exception as e:  # offline, no hub access, a renamed repository: all end here
        what = f"{repo} ({config})" if config else repo
        raise DataError(f"cannot load {what} from the hub: {type(e).__name__}: {e} — fix: download "
                        "its train/test files elsewhere and pass --from DIR") from e


def prepare_gsm8k(out: Path, source: Path | None) -> dict[str, int]:
    """Write ``out/{train,test}.jsonl``; returns the row count per split."""
    if source is not None:
        if not source.is_dir():
            raise DataError(f"--from {source}: not a directory — fix: point --from at the directory holding the "
                            "GSM8K train/test files")
        raw = {}
        for split in SPLITS:
            files = find_split_files(source, split)
            raw[split] = [(f"{f} row {i + 1}", r) for f in files for i, r in enumerate(read_rows(f))]
    else:
        raw = {s: [(f"openai/gsm8k {s} row {i + 1}", r) for i, r in enumerate(rows)]
               for s, rows in _hub_splits("openai/gsm8k", "main").items()}
    checked = {split: [gsm8k_row(r, where) for where, r in raw[split]] for split in SPLITS}
    for split, rows in checked.items():  # every split is checked before any file is written
        if not rows:
            raise DataError(f"GSM8K {split} split is empty — fix: use the original GSM8K files")
    for split, rows in checked.items():
        write_jsonl(rows, out / f"{split}.jsonl")
    counts = {split: len(rows) for split, rows in checked.items()}
    if source is not None:
        lic = next((d / "LICENSE" for d in (source, source / "main") if (d / "LICENSE").is_file()), None)
        if lic is not None:
            shutil.copyfile(lic, out / "LICENSE")
    return counts


def geometry3k_row(row: object, where: str) -> tuple[dict, list[bytes]]:
    """``({"problem", "answer"}, image bytes)`` of one geometry3k row, checked."""
    from areal_cli.data.image_rows import PLACEHOLDER, row_images

    if not isinstance(row, dict):
        raise DataError(f"{where}: not a JSON object — fix: use the original hiyouga/geometry3k files")
    p, a = row.get("problem"), row.get("answer")
    if not isinstance(p, str) or not p.strip() or not isinstance(a, (str, int, float)) or not str(a).strip():
        raise DataError(f"{where}: not a geometry3k row (needs 'problem', 'answer' and 'images'; keys: "
                        f"{sorted(row)}) — fix: use the original hiyouga/geometry3k files")
    imgs = row_images(row.get("images"), Path("."), where)
    if not imgs or p.count(PLACEHOLDER) != len(imgs):
        raise DataError(f"{where}: {len(imgs)} image(s) for {p.count(PLACEHOLDER)} {PLACEHOLDER} placeholder(s) — "
                        "fix: use the original hiyouga/geometry3k files")
    return {"problem": p, "answer": str(a)}, imgs


def _image_ext(raw: bytes) -> str:
    return ".jpg" if raw[:3] == b"\xff\xd8\xff" else ".png"


def prepare_geometry3k(out: Path, source: Path | None) -> dict[str, int]:
    """Write ``out/{train,test}.jsonl`` and ``out/images/<split>/``; returns the row count per split."""
    if source is not None:
        if not source.is_dir():
            raise DataError(f"--from {source}: not a directory — fix: point --from at the directory holding the "
                            "geometry3k train/test parquet files")
        raw = {split: [(f"{f} row {i + 1}", r) for f in find_split_files(source, split)
                       for i, r in enumerate(read_rows(f))] for split in SPLITS}
    else:
        raw = {s: [(f"hiyouga/geometry3k {s} row {i + 1}", r) for i, r in enumerate(rows)]
               for s, rows in _hub_splits("hiyouga/geometry3k", None).items()}
    checked = {split: [geometry3k_row(r, where) for where, r in raw[split]] for split in SPLITS}
    for split, rows in checked.items():  # every split is checked before any file is written
        if not rows:
            raise DataError(f"geometry3k {split} split is empty — fix: use the original hiyouga/geometry3k files")
    for split, rows in checked.items():
        img_dir = out / "images" / split
        img_dir.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, (row, imgs) in enumerate(rows):
            names = []
            for k, im in enumerate(imgs):
                name = f"{i:05d}_{k}{_image_ext(im)}"
                (img_dir / name).write_bytes(im)
                names.append(f"images/{split}/{name}")
            lines.append({"problem": row["problem"], "images": names, "answer": row["answer"]})
        write_jsonl(lines, out / f"{split}.jsonl")
    return {split: len(rows) for split, rows in checked.items()}


RECIPES: dict[str, Callable[[Path, Path | None], dict[str, int]]] = {"gsm8k": prepare_gsm8k,
                                                                      "geometry3k": prepare_geometry3k}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_cli.data.prepare",
                                 description="Write a public dataset as train/test JSONL for a dataset preset.")
    ap.add_argument("name", choices=sorted(RECIPES), help="the dataset")
    ap.add_argument("--out", default=None, help="output directory (default: data/<name>)")
    ap.add_argument("--from", dest="source", default=None,
                    help="a local copy to convert instead of downloading (jsonl or parquet files)")
    args = ap.parse_args(argv)
    out = Path(args.out or f"data/{args.name}")
    try:
        counts = RECIPES[args.name](out, Path(args.source) if args.source else None)
    except ArealError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(", ".join(f"{out / split}.jsonl: {n} rows" for split, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
