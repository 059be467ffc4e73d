"""The ``dataset`` group's checks before launch: files, columns and knobs, read cheaply (no ``datasets``,
no torch; :mod:`areal_cli.data.sources` peeks at the first rows or the schema).

``validate-config`` (and ``areal train``, which validates before anything starts) calls
:func:`check_dataset`; the launcher calls :func:`check_dataset_paths` again just before it starts
processes. Each mistake is one line: a missing path, a field that is not a column (with the columns
that exist and a did-you-mean), knobs that contradict each other (``ConfigError``); a file whose first
rows cannot be read (``DataError``).

Paths on remote launchers: ``slurm``, ``ray`` and ``skypilot`` read the data on the cluster nodes. A path
that this machine cannot see is then a plan warning, not an error (it may exist only there); a path it
can see is checked in full. ``launcher=local`` refuses a missing file.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from areal_cli.data import builtin, builtin_vision
from areal_cli.data.sources import Columns, Source, check_source, parse_source, peek_columns
from areal_cli.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.config.dataset import DatasetConfig
    from areal_cli.config.schema import ExperimentConfig

PROMPT_KINDS = ("text", "chat", "unknown")
ANSWER_KINDS = ("text", "number", "unknown")


def dataset_paths(cfg: DatasetConfig) -> list[tuple[str, str]]:
    """``[(config key, path)]`` of the configured train and test paths."""
    return [(key, getattr(cfg, key)) for key in ("train_path", "test_path") if getattr(cfg, key) is not None]


def check_builtin(key: str, path: str) -> bool:
    """True when ``path`` names a built-in task (an unknown one is a ConfigError)."""
    task = builtin.parse_builtin_path(path)
    if task is None:
        return False
    if task in builtin_vision.VISION_TASKS:
        return True
    if task not in builtin.TASKS:
        names = [*builtin.task_names(), *builtin_vision.task_names()]
        raise ConfigError(f"dataset.{key}", f"unknown built-in task {task!r}",
                          f"{did_you_mean(task, names)}use one of: {', '.join('builtin:' + t for t in names)}")
    return True


def check_dataset_paths(cfg: DatasetConfig, remote: str | None = None) -> list[Source]:
    """Raise for a missing or unreadable local dataset path or an unknown built-in task.

    ``remote``: the launcher's name when it reads the data on other machines; a path not visible here
    is then skipped (returned, so the caller can warn). Returns the skipped sources."""
    unseen: list[Source] = []
    for key, path in dataset_paths(cfg):
        if check_builtin(key, path):
            continue
        src = parse_source(path, f"dataset.{key}")
        if remote and not src.path.exists():
            unseen.append(src)
            continue
        check_source(src)
    return unseen


def check_dataset(cfg: ExperimentConfig, plan: Any) -> None:
    """The validate rule: knobs agree, files exist (or are remote), and their columns hold the fields."""
    from areal_cli.config.where import runs_here, where_it_runs

    d = cfg.dataset
    remote = None if runs_here(cfg) else where_it_runs(cfg)
    check_knobs(d, plan)
    check_visual_task(cfg, plan)
    unseen = set()
    for src in check_dataset_paths(d, remote):
        unseen.add(src.config_path)
        plan.warnings.append(f"{src.config_path}: {src.text} is not visible on this machine; {remote}: it must "
                             "exist there (its columns were not checked)")
    splits: list[str] = []
    for key, path in dataset_paths(d):
        if builtin.parse_builtin_path(path) is not None or f"dataset.{key}" in unseen:
            continue
        cols = peek_columns(parse_source(path, f"dataset.{key}"))
        if getattr(getattr(cfg, "algo", None), "name", None) == "rm":
            check_pair_columns(d, cols, path)
        else:
            check_columns(d, cols, path)
        if key == "train_path":
            splits = cols.splits
    if builtin.parse_builtin_path(d.train_path) is None and d.test_path is None and not d.test_fraction:
        hint = f" (it has a 'test' split: dataset.test_path={d.train_path}:test)" if "test" in splits else ""
        plan.warnings.append("dataset: no held-out evaluation, since dataset.test_path is unset for local data"
                             f"{hint} — set dataset.test_path, or dataset.test_fraction to hold out a share of "
                             "the train file")


def is_visual_path(path: str | None) -> bool:
    return builtin.parse_builtin_path(path) in builtin_vision.VISION_TASKS if path else False


def visual_source(d: DatasetConfig, key: str, path: str) -> str | None:
    """What makes ``path`` visual: ``"a visual task"`` (a built-in one), ``"an image dataset (column X)"``
    (a local file whose schema or first rows have the image column: data/image_rows.py), or None. Reads
    only the columns (sources.py); a path not here is left to the path checks."""
    from areal_cli.data.image_rows import image_column

    if builtin.parse_builtin_path(path) is not None:
        return "a visual task" if is_visual_path(path) else None
    src = parse_source(path, f"dataset.{key}")
    if not src.path.exists():
        return None
    cols = peek_columns(src)
    col = image_column(cols.names, d.image_key)
    if d.image_key and col is None:
        raise ConfigError("dataset.image_key", f"{d.image_key!r} is not a column of {path} (columns: "
                          f"{', '.join(cols.names) or 'none'}; read from {cols.where})",
                          f"{did_you_mean(d.image_key, cols.names)}set dataset.image_key to its image column, or "
                          "null to find 'images'/'image'")
    if col is None:
        return None
    if cols.kind(col) in ("number", "bool", "chat"):
        raise ConfigError("dataset.image_key", f"column {col!r} of {path} holds {cols.kind(col)} values, not "
                          "images (paths, datasets.Image structs or bytes)",
                          "set dataset.image_key to the image column")
    return f"an image dataset (column {col!r})"


def check_visual_task(cfg: ExperimentConfig, plan: Any = None) -> None:
    """Visual data (a built-in visual task, or a local file with an image column) needs a vision-language
    model, servers that carry images, a workflow that sends them, and no algo=rm."""
    from areal_cli.config.model import is_vision_language

    for key, path in dataset_paths(cfg.dataset):
        what = visual_source(cfg.dataset, key, path)
        if what is None:
            continue
        if not is_vision_language(cfg.model):
            raise ConfigError(f"dataset.{key}", f"{path} is {what}, and model {cfg.model.name!r} has no "
                              "vision tower to see its images (docs/vision.md)",
                              "use a vision-language model (model=tiny_vl, qwen2_5_vl_3b, qwen2_5_vl_7b)")
        wf = getattr(getattr(cfg, "workflow", None), "name", "rlvr")
        if wf not in VISUAL_WORKFLOWS and "." not in wf and ":" not in wf:  # a user workflow may send them
            raise ConfigError("workflow.name", f"{wf} does not send a data item's images to the server ({path} is "
                              f"{what})", f"use workflow.name={' or '.join(VISUAL_WORKFLOWS)}")
        if getattr(getattr(cfg, "algo", None), "name", None) == "rm":
            raise ConfigError("algo.name", f"algo=rm trains on text preference pairs, and {path} is {what}",
                              "use a text dataset for algo=rm")
    d = cfg.dataset
    if d.max_image_tokens is not None and d.max_image_tokens > d.max_prompt_len:
        raise ConfigError("dataset.max_image_tokens", f"{d.max_image_tokens} image tokens do not fit in "
                          f"dataset.max_prompt_len={d.max_prompt_len} (the prompt length counts its image tokens)",
                          "lower dataset.max_image_tokens or raise dataset.max_prompt_len")


# The built-in workflows that can send a data item's images (models/vl_inputs.py; an agent through image_url parts).
VISUAL_WORKFLOWS = ("rlvr", "multi_turn", "agent", "agent_proxy")


def check_knobs(d: DatasetConfig, plan: Any) -> None:
    local = builtin.parse_builtin_path(d.train_path) is None
    if d.test_fraction and d.test_path is not None:
        raise ConfigError("dataset.test_fraction", f"{d.test_fraction} holds out part of the train file, but "
                          f"dataset.test_path={d.test_path} names the test data too",
                          "keep one: unset dataset.test_path, or set dataset.test_fraction=0")
    if d.test_fraction and not local:
        raise ConfigError("dataset.test_fraction", "applies to local data; the built-in task generates its own "
                          "test split", "set dataset.test_size instead, or dataset.test_fraction=0")
    if local:
        defaults = {f.name: f.default for f in dataclasses.fields(d)}
        for name in ("train_size", "test_size"):
            if getattr(d, name) != defaults[name]:
                plan.warnings.append(f"dataset.{name}={getattr(d, name)} has no effect: only the built-in task "
                                     "reads it (local data uses every usable row; dataset.eval_size caps the test "
                                     "items)")


def check_pair_columns(d: DatasetConfig, cols: Columns, path: str) -> None:
    """``algo=rm``: ``chosen_field`` and ``rejected_field`` are columns holding text or chats (the rows
    themselves are checked when read: data/preferences.py)."""
    for key, want in (("chosen_field", d.chosen_field), ("rejected_field", d.rejected_field)):
        if want not in cols.names:
            raise ConfigError(f"dataset.{key}", f"{want!r} is not a column of {path} (columns: "
                              f"{', '.join(cols.names) or 'none'}; read from {cols.where}); algo=rm reads "
                              "preference pairs", f"{did_you_mean(want, cols.names)}set dataset.{key} to the column "
                              f"holding the {key.split('_')[0]} side")
        if cols.kind(want) not in PROMPT_KINDS:
            raise ConfigError(f"dataset.{key}", f"column {want!r} of {path} holds {cols.kind(want)} values, not "
                              "text or a chat", f"set dataset.{key} to the column holding the {key.split('_')[0]} side")


def check_columns(d: DatasetConfig, cols: Columns, path: str) -> None:
    """``prompt_field`` and ``answer_field`` are columns of ``cols`` holding a usable kind of value."""
    for key, want, kinds, what in (
            ("prompt_field", d.prompt_field, PROMPT_KINDS, "text or a chat (a list of {role, content} messages)"),
            ("answer_field", d.answer_field, ANSWER_KINDS, "text or a number")):
        if want not in cols.names:
            raise ConfigError(f"dataset.{key}", f"{want!r} is not a column of {path} (columns: "
                              f"{', '.join(cols.names) or 'none'}; read from {cols.where})",
                              f"{did_you_mean(want, cols.names)}set dataset.{key} to one of its columns")
        kind = cols.kind(want)
        if kind not in kinds:
            raise ConfigError(f"dataset.{key}", f"column {want!r} of {path} holds {kind} values, not {what}",
                              f"set dataset.{key} to the column holding the {key.split('_')[0]}")
    if cols.kind(d.prompt_field) == "chat" and not d.use_chat_template:
        raise ConfigError("dataset.use_chat_template", f"is false, but dataset.prompt_field={d.prompt_field} holds "
                          "chats, which only a chat template can render",
                          "set dataset.use_chat_template=true, or point dataset.prompt_field at a text column")
