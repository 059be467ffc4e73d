"""Preference pairs for reward-model training (``algo=rm``): local files, or pairs built from the built-in task.

A row holds two sides, ``chosen`` and ``rejected`` (``dataset.chosen_field`` / ``dataset.rejected_field``),
each one of:

- text: the whole sequence to score, or, when the row has a prompt (``dataset.prompt_field``, else a
  ``prompt`` column), the response to it;
- a chat (``[{"role", "content"}, ...]``): the whole conversation, or, with a prompt, the turns after it
  (HH-RLHF / UltraFeedback layouts). Chats are rendered with the tokenizer's chat template.

A row missing a side (or with an empty or malformed one) is a :class:`~areal_cli.errors.DataError` naming
the file, the row and the side: a pair with one side is no pair, and skipping it would hide a broken
export. Pairs whose longer side has more than ``dataset.max_prompt_len`` tokens are skipped and counted.

Each pair becomes ``{"id", "chosen_ids", "rejected_ids"}`` (token ids, no special tokens added).

The built-in set (``dataset.train_path=builtin:<task>``): every problem of the task's split gives one pair,
its question with the worked correct answer (chosen) against the same answer with a wrong result
(rejected), drawn from the problem's own seeded stream: ``areal train algo=rm`` runs with no data.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from areal_cli.data import builtin
from areal_cli.data.datasets import CHAT_ROLES, DataReport, split_rows
from areal_cli.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.config.dataset import DatasetConfig

# Wrong results of the built-in pairs lie within this distance of the right one (never equal, never < 0).
WRONG_SPREAD = 20


def _chat(value: Any) -> list[dict] | None:
    if not isinstance(value, list) or not value:
        return None
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            return None
    return [{k: v for k, v in m.items() if v is not None} for m in value]


def _side_error(source: str, row: int, side: str, field: str, why: str) -> DataError:
    return DataError(f"{source}: row {row}: the preference pair's {side} side {why} (column {field!r}) — fix: "
                     f"give every row both a 'chosen' and a 'rejected' text or chat (dataset.chosen_field / "
                     f"dataset.rejected_field name other columns), or drop the row")


def render_side(tokenizer: Any, prompt: Any, side: Any, use_chat_template: bool) -> str | None:
    """The text one side scores: ``prompt`` (None, text or chat) followed by ``side`` (text or chat);
    None when ``side`` is neither non-empty text nor a chat."""
    has_template = use_chat_template and getattr(tokenizer, "chat_template", None)
    side_chat = _chat(side)
    if side_chat is None and not (isinstance(side, str) and side.strip()):
        return None
    prompt_chat = _chat(prompt) if isinstance(prompt, list) else (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt.strip() else None)
    if side_chat is not None or (prompt_chat is not None and has_template):
        if not has_template:
            raise DataError("dataset.use_chat_template: a preference chat is rendered only by a chat template — "
                            "fix: set dataset.use_chat_template=true with a model whose tokenizer has one, or "
                            "give the sides as text")
        turns = side_chat if side_chat is not None else [{"role": "assistant", "content": side}]
        return tokenizer.apply_chat_template([*(prompt_chat or []), *turns], tokenize=False)
    return (prompt if isinstance(prompt, str) else "") + side


def build_pairs(rows: list[Any], tokenizer: Any, *, source: str, chosen_field: str = "chosen",
                rejected_field: str = "rejected", prompt_field: str = "prompt", use_chat_template: bool = True,
                max_len: int | None = None, indices: list[int] | None = None) -> tuple[list[dict], DataReport]:
    """Tokenised pairs of ``rows``; a row without both sides raises (see the module docstring)."""
    report = DataReport(path=source, total=len(rows))
    where = indices if indices is not None else list(range(len(rows)))
    texts: list[tuple[int, str, str]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source}: row {where[i]} is not a mapping — fix: one JSON object per row with "
                            "'chosen' and 'rejected'")
        prompt = row.get(prompt_field, row.get("prompt"))
        sides = []
        for side, fld in (("chosen", chosen_field), ("rejected", rejected_field)):
            if row.get(fld) is None:
                raise _side_error(source, where[i], side, fld, "is missing")
            text = render_side(tokenizer, prompt, row[fld], use_chat_template)
            if text is None:
                raise _side_error(source, where[i], side, fld, "is empty or not a text or chat")
            sides.append(text)
        texts.append((i, sides[0], sides[1]))
    flat = [t for _, c, r in texts for t in (c, r)]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    pairs = []
    for k, (i, _, _) in enumerate(texts):
        c, r = list(ids[2 * k]), list(ids[2 * k + 1])
        if max_len is not None and max(len(c), len(r)) > max_len:
            report.skip(where[i], "a side longer than dataset.max_prompt_len")
            continue
        rid = rows[i].get("id")
        pairs.append({"id": str(rid) if rid is not None else f"row-{where[i]}", "chosen_ids": c, "rejected_ids": r})
    report.kept = len(pairs)
    return pairs, report


def builtin_pair_rows(task: str, split: str, n: int, seed: int, *, train_size: int) -> list[dict]:
    """``n`` rows ``{"prompt", "chosen", "rejected"}`` of the built-in task's split: the worked answer, and
    the same answer with a wrong result (within :data:`WRONG_SPREAD`, seeded per split)."""
    train, test = builtin.generate_splits(task, train_size, n if split == "test" else 1, seed=seed)
    rows = train[:n] if split == "train" else test
    rng = random.Random(seed * 7_919 + (1 if split == "train" else 2))
    out = []
    for r in rows:
        right = int(r["ground_truth"])
        wrong = right
        while wrong == right or wrong < 0:
            wrong = right + rng.randint(-WRONG_SPREAD, WRONG_SPREAD)
        work = r["answer"].rsplit("####", 1)[0].rstrip("\n")
        head, _, _ = work.rpartition("=")  # the last step's result is the answer
        out.append({"id": r["id"], "prompt": r["question"], "chosen": r["answer"],
                    "rejected": f"{head}={wrong}\n#### {wrong}"})
    return out


def load_pairs(cfg: "DatasetConfig", tokenizer: Any, split: str, seed: int) -> tuple[list[dict], DataReport] | None:
    """Pairs for ``split`` (``train`` | ``test``) per the ``dataset`` group, as ``datasets.load_split`` reads
    prompts: the built-in task, a file or saved dir, ``test_path``, or ``test_fraction`` of the train file
    (None: no held-out pairs)."""
    from areal_cli.data.datasets import _load_rows

    rows_seed = seed if cfg.seed is None else int(cfg.seed)
    task = builtin.parse_builtin_path(cfg.train_path if split == "train" or cfg.test_path is None
                                      else cfg.test_path)
    kw = dict(chosen_field=cfg.chosen_field, rejected_field=cfg.rejected_field, prompt_field=cfg.prompt_field,
              use_chat_template=cfg.use_chat_template, max_len=cfg.max_prompt_len)
    if task is not None:
        n = cfg.train_size if split == "train" else cfg.test_size
        if n == 0:
            return None
        rows = builtin_pair_rows(task, split, n, rows_seed, train_size=cfg.train_size)
        return build_pairs(rows, tokenizer, source=f"builtin:{task}/{split} (preference pairs)", **kw)
    held_out = cfg.test_path is None and cfg.test_fraction > 0
    if split == "test" and cfg.test_path is None and not held_out:
        return None
    path = cfg.train_path if split == "train" or held_out else cfg.test_path
    config_path = "dataset.train_path" if split == "train" or held_out else "dataset.test_path"
    rows = _load_rows(path, config_path)
    indices = None
    if held_out:
        train_idx, test_idx = split_rows(rows, cfg.test_fraction, rows_seed)
        indices = train_idx if split == "train" else test_idx
        rows = [rows[i] for i in indices]
    pairs, report = build_pairs(rows, tokenizer, source=str(path), indices=indices, **kw)
    if not pairs:
        raise DataError(f"{config_path}: no usable preference pairs in {path!r} ({report.summary()})")
    return pairs, report
