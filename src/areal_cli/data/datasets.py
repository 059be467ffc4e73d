"""Datasets from local files (jsonl / json / parquet / csv / arrow / saved ``datasets`` dirs) or the
built-in task (docs/data.md).

Rows are GSM8K-shaped by default (``question``, and ``answer`` ending in ``#### n``); other field
names are mapped with ``dataset.prompt_field`` / ``dataset.answer_field``. The prompt column holds text
(one user turn) or a chat (``[{"role", "content"}, ...]`` ending in a user turn: system and few-shot
turns), rendered with the tokenizer's chat template. Each usable row becomes a *data item*, the dict
the rollout workflows and the SFT loop consume::

    {"id": str, "question": str (the text, or the chat's last user turn),
     "messages": [{"role": ..., "content": ...}, ...],
     "prompt": str (chat-templated, ends with the assistant header), "prompt_ids": list[int],
     "answer": str (reference: the text after the last ####, else the whole answer),
     "solution": str (the full answer text; the SFT target)}

Malformed rows are skipped, counted per reason and reported (:class:`DataReport`). A missing file
is a :class:`~areal_cli.errors.DataError` naming the config path; ``validate-config`` checks files
and columns cheaply before anything launches (:mod:`areal_cli.data.checks`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_cli.data import builtin
from areal_cli.data.sources import CHAT_KEYS, PEEK_ROWS, check_source, choose_split, parse_source
from areal_cli.errors import ArealError, ConfigError, DataError, did_you_mean

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.config.dataset import DatasetConfig

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
                  ".arrow": "arrow"}
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class DataReport:
    """What happened to the rows of one dataset file."""

    path: str
    total: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_bad_rows: list[int] = field(default_factory=list)  # up to 5 row indices, for the message

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, idx: int, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.first_bad_rows) < 5:
            self.first_bad_rows.append(idx)

    def summary(self) -> str:
        s = f"{self.path}: {self.kept}/{self.total} rows used"
        if self.skipped:
            why = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items()))
            s += f"; skipped {self.n_skipped} ({why}; first bad rows: {self.first_bad_rows})"
        return s


def extract_answer(text: Any) -> str | None:
    """The reference answer: the text after the last ``####`` (commas and ``$`` dropped), else the
    whole stripped text. ``None`` when nothing usable is there."""
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, float)):
        return str(int(text)) if float(text).is_integer() else str(text)
    if not isinstance(text, str):
        return None
    if "####" in text:
        ref = text.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
        return ref or None
    ref = text.strip()
    return ref or None


def _load_rows(path: str, config_path: str) -> list[dict]:
    """Rows of a local file, a saved dir or one split of a saved DatasetDict (``DIR:split``), through the
    ``datasets`` library."""
    import datasets

    src = parse_source(path, config_path)
    check_source(src)
    p = src.path
    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[choose_split(src, list(ds))]
        else:
            ds = datasets.load_dataset(_FILE_BUILDERS[src.suffix], data_files=str(p), split="train",
                                       cache_dir=_hf_cache_dir())
    except ArealError:
        raise
    except Exception as e:  # malformed files surface as many different library errors
        raise DataError(f"{config_path}: cannot read {str(p)!r}: {type(e).__name__}: {e} — fix: repair "
                        "the file, or point it at a .jsonl/.json/.csv/.parquet file (docs/data.md)") from e
    return ds.to_list()


def _hf_cache_dir() -> str | None:
    # Keep the arrow cache out of $HOME when a fileroot-style cache is configured.
    return os.environ.get("AREAL_DATASETS_CACHE") or None


def as_chat(value: Any) -> list[dict] | str:
    """A chat cell as ``[{role, content}, ...]`` ending in a user turn, or why it is not usable."""
    if isinstance(value, dict) and all(isinstance(value.get(k), list) for k in CHAT_KEYS):
        # datasets' legacy Sequence({role, content}) feature loads a list of messages as a dict of lists
        value = [dict(zip(value, vals)) for vals in zip(*value.values())]
    if not isinstance(value, list) or not value:
        return "empty chat"
    msgs = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            return "malformed chat message"
        # Arrow gives every message the keys any message of the column has, as None; templates test presence.
        msgs.append({k: v for k, v in m.items() if v is not None})
    if msgs[-1]["role"] != "user":
        return "chat not ending in a user turn"
    return msgs


def _render_prompts(tokenizer, conversations: list[list[dict]], use_chat_template: bool) -> list[str]:
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                for m in conversations]
    return [m[-1]["content"] for m in conversations]


def _prompt_messages(value: Any, system_prompt: str | None) -> tuple[list[dict] | None, str]:
    """(messages, question) for a prompt cell, or (None, why it is skipped)."""
    if isinstance(value, (list, dict)):
        chat = as_chat(value)
        if isinstance(chat, str):
            return None, chat
        if system_prompt and chat[0]["role"] != "system":  # the chat's own system turn wins
            chat = [{"role": "system", "content": system_prompt}, *chat]
        return chat, chat[-1]["content"]
    if not isinstance(value, str) or not value.strip():
        return None, "missing/empty"
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": value})
    return msgs, value


def build_items(rows: list[dict], tokenizer, *, prompt_field: str = "question",
                answer_field: str = "answer", use_chat_template: bool = True,
                system_prompt: str | None = None, max_prompt_len: int | None = None,
                source: str = "<rows>", id_prefix: str = "",
                indices: list[int] | None = None) -> tuple[list[dict], DataReport]:
    """Turn raw rows into data items, skipping (and counting) malformed ones.

    ``prompt_field`` holds text (one user turn, after ``system_prompt`` when set) or a chat; ``indices``:
    the rows' positions in their file (default 0..n-1), for ids and the report."""
    report = DataReport(path=source, total=len(rows))
    where = indices if indices is not None else range(len(rows))
    staged: list[tuple[int, str, str, str, list[dict]]] = []
    n_chats = 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            report.skip(where[i], "not a mapping")
            continue
        msgs, q = _prompt_messages(row.get(prompt_field), system_prompt)
        if msgs is None:
            report.skip(where[i], f"{q} {prompt_field!r}" if q == "missing/empty" else f"{q} in {prompt_field!r}")
            continue
        n_chats += not isinstance(row.get(prompt_field), str)
        raw_ans = row.get(answer_field)
        ref = extract_answer(raw_ans)
        if ref is None:
            report.skip(where[i], f"missing/unparseable {answer_field!r}")
            continue
        solution = raw_ans if isinstance(raw_ans, str) else str(raw_ans)
        staged.append((i, q, ref, solution, msgs))
    if n_chats and not (use_chat_template and getattr(tokenizer, "chat_template", None)):
        why = "dataset.use_chat_template is false" if not use_chat_template else "the tokenizer has no chat template"
        raise DataError(f"dataset.prompt_field: {prompt_field!r} of {source} holds chats, and {why}; a chat is "
                        "rendered only by a chat template — fix: set dataset.use_chat_template=true with a model "
                        "whose tokenizer has one, or point dataset.prompt_field at a text column")
    prompts = _render_prompts(tokenizer, [s[4] for s in staged], use_chat_template)
    # One batched call to the Rust tokenizer: ~50x faster than per-row calls on 20k rows.
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    items: list[dict] = []
    for (i, q, ref, solution, msgs), prompt, pids in zip(staged, prompts, ids):
        if max_prompt_len is not None and len(pids) > max_prompt_len:
            report.skip(where[i], "prompt longer than dataset.max_prompt_len")
            continue
        rid = rows[i].get("id")
        items.append({"id": str(rid) if rid is not None else f"{id_prefix}{where[i]}", "question": q,
                      "messages": msgs, "prompt": prompt, "prompt_ids": list(pids),
                      "answer": ref, "solution": solution})
    report.kept = len(items)
    report.first_bad_rows.sort()
    return items, report


def check_dataset_paths(cfg: DatasetConfig) -> None:
    """Raise a ConfigError naming the config path for a missing file or an unknown built-in task.

    Cheap and torch-free; ``data.checks`` holds the checks (and the rule for remote launchers)."""
    from areal_cli.data.checks import check_dataset_paths as check

    check(cfg)


def split_rows(rows: list, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, test indices) of ``rows``: a seeded draw of ``round(fraction * n)`` test rows (at
    least one), each split in file order."""
    import random

    n = len(rows)
    n_test = max(1, round(fraction * n))
    if n_test >= n:
        raise DataError(f"dataset.test_fraction: {fraction} of {n} rows leaves no train rows — fix: lower "
                        "dataset.test_fraction or add rows")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[n_test:]), sorted(order[:n_test])


def load_split(cfg: DatasetConfig, tokenizer, split: str = "train",
               seed: int = 0) -> tuple[list[dict], DataReport] | None:
    """Data items for ``split`` (``train`` | ``test``) per the ``dataset`` config.

    Local data without ``test_path``: ``dataset.test_fraction`` of the train file's rows make the test
    split (and are left out of train); with ``test_fraction=0`` there is no held-out eval: ``None``.
    A column that no row has means the field mapping is wrong: a :class:`DataError`, not 100% skipped rows.
    """
    key = "train_path" if split == "train" else "test_path"
    path = getattr(cfg, key)
    rows_seed = seed if cfg.seed is None else int(cfg.seed)  # dataset.seed fixes the rows alone
    local_train = builtin.parse_builtin_path(cfg.train_path) is None
    held_out = local_train and cfg.test_path is None and cfg.test_fraction > 0
    if split == "test" and path is None:
        if local_train and not held_out:
            return None
        path = cfg.train_path
    config_path = "dataset.train_path" if held_out else f"dataset.{key}"
    task = builtin.parse_builtin_path(path)
    from areal_cli.data import builtin_vision

    if task is not None and task in builtin_vision.VISION_TASKS:
        train_rows, test_rows = builtin_vision.generate_splits(task, cfg.train_size, cfg.test_size, seed=rows_seed)
        items, report = build_vision_items(train_rows if split == "train" else test_rows, tokenizer,
                                           system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len,
                                           max_image_pixels=cfg.max_image_pixels,
                                           max_image_tokens=cfg.max_image_tokens, source=f"builtin:{task}/{split}")
    elif task is not None:
        if task not in builtin.TASKS:
            check_dataset_paths(cfg)  # raises the ConfigError with the fix
        train_rows, test_rows = builtin.generate_splits(task, cfg.train_size, cfg.test_size, seed=rows_seed)
        rows = train_rows if split == "train" else test_rows
        items, report = build_items(rows, tokenizer, prompt_field="question", answer_field="answer",
                                    use_chat_template=cfg.use_chat_template,
                                    system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len,
                                    source=f"builtin:{task}/{split}")
    else:
        rows = _load_rows(path, config_path)
        _check_fields(cfg, rows, path)
        image_col = _image_column(cfg, rows, path)
        indices = None
        if held_out:
            train_idx, test_idx = split_rows(rows, cfg.test_fraction, rows_seed)
            indices = train_idx if split == "train" else test_idx
            rows = [rows[i] for i in indices]
        source = f"{path} ({split} share, dataset.test_fraction)" if held_out else str(path)
        id_prefix = "row-" if held_out else f"{split}-"
        if image_col is not None:  # a visual dataset: the built-in visual tasks' item path (docs/vision.md)
            from areal_cli.data.image_rows import visual_rows

            where = parse_source(path, config_path).path
            rows = visual_rows(rows, image_col, cfg.prompt_field, where if where.is_dir() else where.parent,
                               str(path), indices)
            items, report = build_vision_items(
                rows, tokenizer, system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len,
                max_image_pixels=cfg.max_image_pixels, max_image_tokens=cfg.max_image_tokens, source=source,
                prompt_field=cfg.prompt_field, answer_field=cfg.answer_field, id_prefix=id_prefix, indices=indices)
        else:
            items, report = build_items(rows, tokenizer, prompt_field=cfg.prompt_field,
                                        answer_field=cfg.answer_field, use_chat_template=cfg.use_chat_template,
                                        system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len,
                                        source=source, id_prefix=id_prefix, indices=indices)
    if split == "test" and cfg.eval_size is not None:
        items = items[: cfg.eval_size]
    if report.n_skipped:
        logger.warning("dataset %s", report.summary())
    else:
        logger.info("dataset %s", report.summary())
    if not items:
        raise DataError(f"{config_path}: no usable rows in {path!r} ({report.summary()})")
    return items, report


def _image_column(cfg: DatasetConfig, rows: list, path: str) -> str | None:
    """The rows' image column (data/image_rows.py); ``dataset.image_key`` naming no column is an error."""
    from areal_cli.data.image_rows import image_column

    names = list(dict.fromkeys(k for r in rows[:PEEK_ROWS] if isinstance(r, dict) for k in r))
    col = image_column(names, cfg.image_key)
    if cfg.image_key and col is None:
        raise ConfigError("dataset.image_key", f"{cfg.image_key!r} is not a column of {path} (columns: {names})",
                          f"{did_you_mean(cfg.image_key, names)}set dataset.image_key to the image column, or "
                          "null to find 'images'/'image'")
    return col


def _check_fields(cfg: DatasetConfig, rows: list, path: str) -> None:
    for fld, key_name in ((cfg.prompt_field, "prompt_field"), (cfg.answer_field, "answer_field")):
        if rows and not any(isinstance(r, dict) and fld in r for r in rows):
            cols = sorted(rows[0]) if isinstance(rows[0], dict) else []
            raise DataError(f"dataset.{key_name}: no row of {path!r} has a {fld!r} column (columns: {cols}) — "
                            f"fix: {did_you_mean(fld, cols)}set dataset.{key_name} to one of the file's columns")


# ---------------------------------------------------------------- visual tasks (builtin_vision.py)
# A row's image(s) ride in the item ("images": PNG bytes, prompt order) beside a chat whose user turn holds one
# image part per image and the question; no "prompt_ids": the rollout renders the chat and expands each image's
# pads itself (models/vl_inputs.py), where the pixels are computed too (kept out of the item: 2000 items of pixel
# values would be ~200 MB). "prompt_len" counts each image as the tokens the processor gives it, and
# dataset.max_prompt_len applies to that; dataset.max_image_pixels skips a row with a larger image.

def image_size(img: Any) -> tuple[int, int]:
    """(width, height) read from the image's header."""
    from areal_cli.models.vl_inputs import to_pil

    pil = to_pil(img)
    return pil.width, pil.height


def build_vision_items(rows: list[dict], tokenizer: Any, *, system_prompt: str | None = None,
                       max_prompt_len: int | None = None, max_image_pixels: int | None = None,
                       max_image_tokens: int | None = None, source: str = "<rows>", prompt_field: str = "question",
                       answer_field: str = "answer", id_prefix: str | None = None,
                       indices: list[int] | None = None) -> tuple[list[dict], DataReport]:
    """Items of rows with images (a built-in visual task's, or a local file's: data/image_rows.py); the prompt
    text's ``<image>`` placeholders place the images in the user turn, else they go before the text."""
    from areal_cli.data.image_rows import content_parts
    from areal_cli.models.vl_inputs import image_token_count, item_images

    report = DataReport(path=source, total=len(rows))
    items: list[dict] = []
    tokens_of: dict[tuple[int, int], int] = {}
    where_of = indices if indices is not None else range(len(rows))
    for i, row in zip(where_of, rows):
        if not isinstance(row, dict):
            report.skip(i, "not a mapping")
            continue
        q = row.get(prompt_field)
        imgs = item_images(row)
        ref = extract_answer(row.get(answer_field))
        if not isinstance(q, str) or not q.strip():
            report.skip(i, f"missing/empty {prompt_field!r}")
            continue
        if not imgs:
            report.skip(i, "no image")
            continue
        if ref is None:
            report.skip(i, f"missing/unparseable {answer_field!r}")
            continue
        sizes = [image_size(im) for im in imgs]
        if max_image_pixels is not None and any(w * h > max_image_pixels for w, h in sizes):
            report.skip(i, "image larger than dataset.max_image_pixels")
            continue
        content = content_parts(q, len(imgs), f"{source} row {i}")
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": content}]
        prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        n_text = len(tokenizer.encode(prompt, add_special_tokens=False)) - len(imgs)
        for s in sizes:
            if s not in tokens_of:
                tokens_of[s] = image_token_count(tokenizer, *s)
        n_image = sum(tokens_of[s] for s in sizes)
        if max_image_tokens is not None and n_image > max_image_tokens:
            report.skip(i, "more image tokens than dataset.max_image_tokens")
            continue
        n = n_text + n_image
        if max_prompt_len is not None and n > max_prompt_len:
            report.skip(i, "prompt longer than dataset.max_prompt_len (image tokens counted)")
            continue
        answer = row.get(answer_field)
        rid = row.get("id")
        default_id = f"{source}-{i}" if id_prefix is None else f"{id_prefix}{i}"
        items.append({"id": str(rid) if rid is not None else default_id, "question": q, "images": [bytes(im) if
                      isinstance(im, (bytes, bytearray)) else im for im in imgs], "messages": msgs,
                      "prompt": prompt, "prompt_len": n, "answer": ref, "colour": row.get("colour"),
                      "solution": answer if isinstance(answer, str) else str(answer)})
    report.kept = len(items)
    return items, report
