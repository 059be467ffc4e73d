"""Walk the ExperimentConfig dataclass tree by dotted path; did-you-mean for unknown keys.

Pure Python (no Hydra/OmegaConf) so override keys are checked before composing, with messages
that name the dotted path and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any

from areal_cli.errors import ConfigError


# Keys that existed once: (reason, fix) instead of a did-you-mean.
RETIRED = {
    "engine.mixed_precision": ("was folded into engine.dtype (bf16 compute with fp32 master weights on every "
                               "engine)", "use engine.dtype=bfloat16"),
    "cluster.hosts": ("no launcher reads a host list: launcher=local runs on this machine alone, and slurm, "
                      "ray and skypilot find their nodes themselves",
                      "drop cluster.hosts; for several nodes use launcher=slurm, launcher=ray or "
                      "launcher=skypilot; to check a shared path on given hosts run "
                      "`areal check-storage PATH --hosts h1,h2`"),
}


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def describe_type(tp: Any) -> str:
    tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    if set(typing.get_args(tp)) == {int, str}:  # a number or a word such as auto (config/ranges.py)
        return "an integer or auto"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


@functools.lru_cache(maxsize=None)
def all_paths(root: type) -> tuple[str, ...]:
    """Every dotted leaf and section path of the schema."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = _strip_optional(_hints(cls)[f.name])
            path = f"{prefix}{f.name}"
            out.append(path)
            if dataclasses.is_dataclass(tp):
                walk(tp, path + ".")

    walk(root, "")
    return tuple(out)


def resolve_path(root: type, path: str) -> Any:
    """Return the declared type at ``path`` or raise a ConfigError with a did-you-mean.

    Keys below a ``dict`` field are free-form and accepted (their type is ``Any``).
    """
    parts = path.split(".")
    cls: Any = root
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(cls):
            origin = typing.get_origin(cls)
            if origin is dict or cls is Any:
                return Any
            parent = ".".join(parts[:i])
            raise ConfigError(here, f"'{parent}' is a value ({describe_type(cls)}), not a section",
                              f"set {parent}=<value>")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names and here in RETIRED:
            raise ConfigError(here, *RETIRED[here])
        if part not in names:
            raise ConfigError(here, f"unknown config key '{part}'" +
                              (f" in '{'.'.join(parts[:i])}'" if i else ""),
                              suggest(root, parts[:i], part, names))
        cls = _strip_optional(_hints(cls)[part])
    return cls


def suggest(root: type, parent: list[str], key: str, siblings: list[str]) -> str:
    prefix = ".".join(parent) + "." if parent else ""
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    # The key may live elsewhere (e.g. algo.lr → algo.optim.lr, rollout.batch_size → algo.batch_size).
    paths = all_paths(root)
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    same_leaf.sort(key=lambda p: (not p.startswith(prefix), len(p)))
    if same_leaf:
        return f"did you mean '{same_leaf[0]}'?"
    leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    if close:
        return f"did you mean '{leaves[close[0]]}'?"
    shown = ", ".join(siblings[:12]) + (", …" if len(siblings) > 12 else "")
    return f"valid keys{' under ' + prefix[:-1] if prefix else ''}: {shown}"
