"""Where a dataset path points, and which columns it has, read cheaply (no ``datasets``, no torch).

A configured path that is wrong (missing, an unsupported file type, a directory that is no saved dataset,
an unknown split) is a ``ConfigError`` at its config key; a file whose contents cannot be read is a
``DataError``.

``validate-config`` runs before anything starts and must stay well under a second, so a file's columns
come from its first rows or its schema, never from loading it:

- JSONL / JSON: the first records (:data:`PEEK_ROWS` of them, at most :data:`PEEK_BYTES`), with ``json``;
- Parquet: ``pyarrow.parquet.read_schema`` (the footer only);
- CSV: the header line;
- Arrow IPC (``.arrow``): the stream's schema;
- a saved ``datasets`` directory: the ``features`` of its ``dataset_info.json``.

A saved ``DatasetDict`` directory names one split with ``DIR:split`` (``data/gsm8k_dd:test``); without
one, its ``train`` split (else its first) is read. A path that exists as written is never split at a
colon.

Each column gets a *kind*: ``text``, ``chat`` (a list of ``{role, content}`` messages), ``number``,
``bool``, ``list``, ``struct`` or ``unknown`` (CSV cells, or no non-null value among the rows read).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_cli.errors import ConfigError, DataError

FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
PEEK_ROWS = 50
PEEK_BYTES = 1 << 20
CHAT_KEYS = ("role", "content")


@dataclass(frozen=True)
class Source:
    """A configured dataset path, resolved: the file or directory, and the split of a saved DatasetDict."""

    config_path: str  # "dataset.train_path"
    text: str  # as configured
    path: Path
    split: str | None = None  # "test" for "DIR:test"

    @property
    def suffix(self) -> str:
        return self.path.suffix.lower()


@dataclass
class Columns:
    """A source's columns and their kinds, from ``where`` (what was read)."""

    names: list[str]
    kinds: dict[str, str] = field(default_factory=dict)
    where: str = ""
    splits: list[str] = field(default_factory=list)  # a saved DatasetDict's splits

    def kind(self, name: str) -> str:
        return self.kinds.get(name, "unknown")


def parse_source(text: str, config_path: str) -> Source:
    """``DIR:split`` → the directory and the split; any other path as it is."""
    path = Path(os.path.expanduser(text))
    if not path.exists() and ":" in text:
        base, _, split = text.rpartition(":")
        if base and split and "/" not in split and os.sep not in split:
            return Source(config_path, text, Path(os.path.expanduser(base)), split)
    return Source(config_path, text, path)


def missing_error(src: Source) -> ConfigError:
    what = f"{str(src.path)!r} (split {src.split!r})" if src.split else repr(str(src.path))
    return ConfigError(src.config_path, f"dataset file {what} does not exist",
                       f"point {src.config_path} at a .jsonl/.parquet file or a saved datasets dir, or use "
                       "builtin:arith")


def check_source(src: Source) -> None:
    """The path exists and is a readable kind of dataset (a supported file or a saved dir)."""
    if not src.path.exists():
        raise missing_error(src)
    if src.path.is_dir():
        saved_dir_layout(src)
        return
    if src.split is not None:
        raise ConfigError(src.config_path, f"{str(src.path)!r} is a file; ':{src.split}' names a split of a "
                          "saved DatasetDict directory", f"drop ':{src.split}'")
    if src.suffix not in FILE_TYPES:
        raise ConfigError(src.config_path, f"unsupported dataset file type {src.path.suffix!r}",
                          "use .jsonl, .json, .parquet, .csv, .arrow or a saved datasets dir")


def saved_dir_layout(src: Source) -> tuple[Path, list[str]]:
    """The directory of the chosen split of a saved dataset dir (the dir itself for a single Dataset)
    and the DatasetDict's split names ([] for a single Dataset)."""
    d = src.path
    dict_file = d / "dataset_dict.json"
    if dict_file.is_file():
        try:
            splits = [str(s) for s in json.loads(dict_file.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{src.config_path}: cannot read {str(dict_file)!r}: {e} — fix: re-save the "
                            "dataset with DatasetDict.save_to_disk") from e
        return d / choose_split(src, splits), splits
    if (d / "state.json").is_file():
        if src.split is not None:
            raise ConfigError(src.config_path, f"{str(d)!r} is a single saved Dataset, not a DatasetDict, so it "
                              f"has no split {src.split!r}", f"drop ':{src.split}'")
        return d, []
    raise ConfigError(src.config_path, f"{str(d)!r} is a directory but not a saved datasets dir (no "
                      "dataset_dict.json or state.json)", "write it with Dataset.save_to_disk / "
                      "DatasetDict.save_to_disk, or point at a .jsonl/.parquet file")


def choose_split(src: Source, splits: list[str]) -> str:
    """The named split, else ``train``, else the first."""
    from areal_cli.errors import did_you_mean

    if src.split is not None:
        if src.split not in splits:
            raise ConfigError(src.config_path, f"{str(src.path)!r} has no split {src.split!r} (splits: "
                              f"{', '.join(splits)})", f"{did_you_mean(src.split, splits)}name one of its splits")
        return src.split
    if not splits:
        raise DataError(f"{src.config_path}: {str(src.path)!r} is a DatasetDict without splits — fix: save one "
                        "with at least a train split")
    return "train" if "train" in splits else splits[0]


def peek_columns(src: Source) -> Columns:
    """The columns of an existing source (see the module docstring for what is read)."""
    check_source(src)
    try:
        if src.path.is_dir():
            return _saved_dir_columns(src)
        if src.suffix in (".jsonl", ".json"):
            return _json_columns(src)
        if src.suffix == ".parquet":
            return _parquet_columns(src)
        if src.suffix == ".csv":
            return _csv_columns(src)
        return _arrow_columns(src)
    except (DataError, ConfigError):
        raise
    except Exception as e:  # a damaged file surfaces as many different library errors
        raise DataError(f"{src.config_path}: cannot read {str(src.path)!r}: {type(e).__name__}: {e} — fix: check "
                        f"that it is a whole, valid {src.suffix or 'datasets'} file") from e


def _json_columns(src: Source) -> Columns:
    with open(src.path, encoding="utf-8") as f:
        text = f.read(PEEK_BYTES)
    try:
        records = first_json_records(text, PEEK_ROWS, cut=len(text) >= PEEK_BYTES)
    except (ValueError, TypeError) as e:
        raise DataError(f"{src.config_path}: {str(src.path)!r}: {e} — fix: write one JSON object per line "
                        "(JSONL) or a JSON list of objects") from e
    if not records:
        if not text.strip():
            raise DataError(f"{src.config_path}: {str(src.path)!r} is empty — fix: point it at a file with rows")
        raise DataError(f"{src.config_path}: {str(src.path)!r} does not start with a JSON object — fix: "
                        "write one JSON object per line (JSONL) or a JSON list of objects")
    names: dict[str, None] = {}
    kinds: dict[str, str] = {}
    for r in records:
        for k, v in r.items():
            names.setdefault(k)
            if k not in kinds and v is not None:
                kinds[k] = value_kind(v)
    return Columns(list(names), kinds, "its first row" if len(records) == 1 else f"its first {len(records)} rows")


def first_json_records(text: str, limit: int, cut: bool = False) -> list[dict]:
    """Up to ``limit`` leading objects of JSONL or of a JSON list. ``cut``: ``text`` is the start of a
    longer file, so a record running past its end is not an error. A malformed record is a
    ``ValueError`` (not an object: ``TypeError``): the loader would refuse the file too."""
    dec = json.JSONDecoder()
    i, n = 0, len(text)
    out: list[dict] = []

    def skip(j: int) -> int:
        while j < n and text[j] in " \t\r\n,":
            j += 1
        return j

    i = skip(i)
    in_list = i < n and text[i] == "["
    i += in_list
    while len(out) < limit:
        i = skip(i)
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # The read window cut the last record (a JSONL line, or a list's record over several lines).
            if cut and out and (in_list or "\n" not in text[i:]):
                break
            line = text.count("\n", 0, e.pos) + 1
            raise ValueError(f"line {line} is not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise TypeError(f"record {len(out) + 1} is a {type(obj).__name__}, not a JSON object")
        out.append(obj)
    return out


def value_kind(v: Any) -> str:
    """The kind of one JSON value (see the module docstring)."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, str):
        return "text"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, list):
        if v and all(isinstance(m, dict) and all(k in m for k in CHAT_KEYS) for m in v):
            return "chat"
        return "list"
    if isinstance(v, dict):
        return "struct"
    return "unknown"


def _parquet_columns(src: Source) -> Columns:
    import pyarrow.parquet as pq

    schema = pq.read_schema(str(src.path))
    return Columns(list(schema.names), {f.name: arrow_kind(f.type) for f in schema}, "its schema")


def _arrow_columns(src: Source) -> Columns:
    import pyarrow as pa

    with pa.memory_map(str(src.path)) as f:
        try:
            schema = pa.ipc.open_stream(f).schema
        except pa.ArrowInvalid:
            f.seek(0)
            schema = pa.ipc.open_file(f).schema
    return Columns(list(schema.names), {f.name: arrow_kind(f.type) for f in schema}, "its schema")


def arrow_kind(t: Any) -> str:
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        if pa.types.is_struct(v) and all(v.get_field_index(k) >= 0 for k in CHAT_KEYS):
            return "chat"
        return "list"
    if pa.types.is_struct(t):
        return "struct"
    return "unknown"


def _csv_columns(src: Source) -> Columns:
    with open(src.path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise DataError(f"{src.config_path}: {str(src.path)!r} has no header line — fix: name the columns in "
                        "the first line")
    return Columns(header, {}, "its header")


def _saved_dir_columns(src: Source) -> Columns:
    split_dir, splits = saved_dir_layout(src)
    info = split_dir / "dataset_info.json"
    features = json.loads(info.read_text()).get("features") if info.is_file() else None
    if not isinstance(features, dict):
        raise DataError(f"{src.config_path}: {str(info)!r} lists no features — fix: re-save the dataset with "
                        "save_to_disk")
    where = f"its {split_dir.name!r} split's dataset_info.json" if splits else "its dataset_info.json"
    return Columns(list(features), {k: feature_kind(v) for k, v in features.items()}, where, splits)


def feature_kind(feat: Any) -> str:
    """The kind of a ``datasets`` feature as ``dataset_info.json`` serialises it."""
    if isinstance(feat, list):  # the legacy spelling of a list feature: [inner]
        return _list_kind(feat[0] if feat else None)
    if not isinstance(feat, dict):
        return "unknown"
    ftype = feat.get("_type")
    if ftype == "Value":
        dtype = str(feat.get("dtype", ""))
        if dtype in ("string", "large_string"):
            return "text"
        if dtype == "bool":
            return "bool"
        if dtype.startswith(("int", "uint", "float", "decimal")):
            return "number"
        return "unknown"
    if ftype in ("List", "LargeList", "Sequence"):
        return _list_kind(feat.get("feature"))
    if ftype is None:
        return "struct"
    return "unknown"


def _list_kind(inner: Any) -> str:
    if isinstance(inner, dict) and "_type" not in inner and all(k in inner for k in CHAT_KEYS):
        return "chat"
    return "list"
