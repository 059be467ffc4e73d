"""A Hydra-equivalent composer for the common case, without importing Hydra or OmegaConf.

Hydra costs ~0.5-1 s of import and compose time, which would make ``areal validate-config``
sluggish. This module reproduces exactly what Hydra does for the shapes this project's conf
dir uses — a primary defaults list of ``group: option`` entries, group files merged at their
group's package, a ``_global_`` experiment whose defaults are ``override /group: option``, and
plain ``key=value`` overrides with primitive values — and returns ``None`` for anything else
(``+``/``~`` overrides, lists, interpolations, unusual package headers, any value it cannot
convert with certainty), in which case the caller uses Hydra itself. Equivalence with Hydra is
checked by property tests (tests/unit/config/test_config_fastcompose.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from pathlib import Path
from typing import Any

from areal_cli.config.paths import _hints, _strip_optional, describe_type
from areal_cli.config.schema import ExperimentConfig
from areal_cli.errors import ConfigError


class Unsupported(Exception):
    """The fast path cannot decide; compose with Hydra."""


_INT = re.compile(r"^[+-]?(0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^[+-]?((\d+\.\d*|\.\d+)([eE][+-]?\d+)?|\d+[eE][+-]?\d+)$")
_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./:\-]*$")
_QUOTED = re.compile(r"^'([^'\\$]*)'$|^\"([^\"\\$]*)\"$")


def parse_value(text: str) -> Any:
    """Hydra's override-grammar value for the primitive forms; Unsupported otherwise."""
    v = text.strip()
    m = _QUOTED.match(v)
    if m:
        return m.group(1) if m.group(1) is not None else m.group(2)
    low = v.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(v):
        return int(v)
    if _FLOAT.match(v):
        return float(v)
    if low in ("inf", "+inf", "-inf", "nan", "+nan", "-nan"):
        raise Unsupported(v)
    if _PLAIN.match(v) and low not in ("true", "false", "null"):
        return v
    raise Unsupported(v)


def _load_yaml(path: Path) -> tuple[str | None, Any]:
    """(package header or None, data); memoised per (path, mtime, size). Callers never mutate.

    A missing file (an experiment naming an option that does not exist) or malformed YAML is
    Hydra's to report, with its own message: Unsupported."""
    import yaml

    try:
        st = path.stat()
        return _load_yaml_cached(str(path), st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        raise Unsupported(f"{path} does not exist") from None
    except yaml.YAMLError:
        raise Unsupported(f"{path} is not valid YAML") from None


@functools.lru_cache(maxsize=256)
def _load_yaml_cached(path: str, mtime_ns: int, size: int) -> tuple[str | None, Any]:
    import yaml

    text = Path(path).read_text()
    header = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("# @package"):
            header = s[len("# @package"):].strip()
            break
        if s and not s.startswith("#"):
            break
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return header, yaml.load(text, Loader=loader)


def _convert(value: Any, tp: Any, path: str, from_cli: bool) -> Any:
    """Convert like an OmegaConf typed node would, or raise Unsupported when unsure."""
    optional = _strip_optional(tp) is not tp or tp is type(None)
    base = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise Unsupported(path)
    origin = typing.get_origin(base)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise Unsupported(path)
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            raise ConfigError(path, f"expected {describe_type(base)}, got {value!r}",
                              f"set {path} to {describe_type(base)}")
        raise Unsupported(path)
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
                raise Unsupported(path)
            return float(value)
        if isinstance(value, str) and not from_cli and _FLOAT.match(value.strip()):
            return float(value)
        if from_cli and isinstance(value, str):
            raise ConfigError(path, f"expected {describe_type(base)}, got {value!r}",
                              f"set {path} to {describe_type(base)}")
        raise Unsupported(path)
    if base is str:
        if isinstance(value, str):
            return value
        raise Unsupported(path)
    if set(typing.get_args(base)) == {int, str}:
        # A number or a word (``auto``): OmegaConf's Union node keeps either as given; which words are allowed
        # is the range check's (config/ranges.py), as it is after a Hydra compose.
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            return value
        if from_cli:
            raise ConfigError(path, f"expected {describe_type(base)}, got {value!r}",
                              f"set {path} to {describe_type(base)}")
        raise Unsupported(path)
    if origin is list and not from_cli:
        (elem,) = typing.get_args(base) or (Any,)
        if isinstance(value, list) and elem is str and all(isinstance(x, str) for x in value):
            return list(value)
        raise Unsupported(path)
    if origin is dict and not from_cli:
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(x, str)
                                           for k, x in value.items()):
            return dict(value)
        raise Unsupported(path)
    raise Unsupported(path)


@functools.lru_cache(maxsize=None)
def _info(cls: type) -> dict[str, tuple[Any, Any, bool]]:
    """field -> (declared type, type without Optional, is a nested dataclass)."""
    hints = _hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        base = _strip_optional(hints[f.name])
        out[f.name] = (hints[f.name], base, dataclasses.is_dataclass(base))
    return out


def _merge(tree: dict, cls: type, data: Any, prefix: str, trace: dict | None = None, label: str = "") -> None:
    """Deep-merge YAML ``data`` into the plain-dict ``tree`` of dataclass ``cls``; ``trace`` (dotted path ->
    ``label``) records which file set each value."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise Unsupported(prefix)
    info = _info(cls)
    for key, value in data.items():
        if not isinstance(key, str) or key not in info:
            raise Unsupported(f"{prefix}{key}")  # Hydra produces the error
        declared, base, nested = info[key]
        if nested:
            if not isinstance(value, dict) or not isinstance(tree.get(key), dict):
                raise Unsupported(f"{prefix}{key}")
            _merge(tree[key], base, value, f"{prefix}{key}.", trace, label)
        else:
            tree[key] = _convert(value, declared, f"{prefix}{key}", from_cli=False)
            if trace is not None:
                trace[f"{prefix}{key}"] = label


def _to_tree(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, dict):
        return dict(obj)
    return obj


@functools.lru_cache(maxsize=1)
def _default_tree() -> dict:
    return _to_tree(ExperimentConfig())


def _copy_tree(tree: dict) -> dict:
    out = {}
    for k, v in tree.items():
        out[k] = _copy_tree(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v
    return out


def _build(cls: type, tree: dict) -> Any:
    kwargs = {}
    for name, (_, base, nested) in _info(cls).items():
        v = tree[name]
        kwargs[name] = _build(base, v) if nested else v
    return cls(**kwargs)


def _option_file(dirs: list[Path], group: str, option: str) -> Path:
    """The first ``group/option.yaml`` on the search path (a missing one: the first dir's, which
    :func:`_load_yaml` reports as Unsupported, so Hydra words the error)."""
    for d in dirs:
        f = d / group / f"{option}.yaml"
        if f.is_file():
            return f
    return dirs[0] / group / f"{option}.yaml"


def _defaults(conf_dir: Path) -> list[tuple[str, str]]:
    header, data = _load_yaml(conf_dir / "config.yaml")
    if header is not None or not isinstance(data, dict) or set(data) != {"defaults"}:
        raise Unsupported("config.yaml")
    entries = data["defaults"]
    if not entries or entries[0] != "base_config" or entries[-1] != "_self_":
        raise Unsupported("config.yaml defaults")
    out = []
    for e in entries[1:-1]:
        if not isinstance(e, dict) or len(e) != 1:
            raise Unsupported("config.yaml defaults")
        (g, o), = e.items()
        if not isinstance(o, str):
            raise Unsupported("config.yaml defaults")
        out.append((g, o))
    return out


def fast_compose(hydra_overrides: list[str], conf_dir: Path | list[Path],
                 trace: dict | None = None) -> ExperimentConfig | None:
    """The composed typed config, or None when Hydra must decide. ``conf_dir``: the packaged conf dir,
    or the whole search path (user dirs first, the packaged dir, which holds ``config.yaml``, last).

    Only :class:`Unsupported` falls back (every case is raised on purpose, where the input is
    outside what this module reproduces); any other exception is a bug here and propagates rather
    than hiding behind a silent Hydra compose (tests/unit/config/test_config_fastcompose.py pins both).
    ``trace``, when given, is filled with where each value that is not the schema's default was set:
    ``{"trainer.total_steps": "experiment=real_model", "algo.optim.lr": "the command line", ...}``."""
    try:
        return _compose(hydra_overrides, conf_dir, trace)
    except Unsupported:
        return None


def _compose(hydra_overrides: list[str], conf_dir: Path | list[Path],
             trace: dict | None = None) -> ExperimentConfig:
    dirs = list(conf_dir) if isinstance(conf_dir, (list, tuple)) else [conf_dir]
    defaults = _defaults(dirs[-1])
    groups = [g for g, _ in defaults]
    choices = dict(defaults)
    cli_choices: dict[str, str] = {}
    values: list[tuple[str, str]] = []
    for ov in hydra_overrides:
        if ov[:1] in "+~" or "=" not in ov:
            raise Unsupported(ov)
        key, value = ov.split("=", 1)
        if key in choices:
            if not _PLAIN.match(value) or "/" in value:
                raise Unsupported(ov)
            cli_choices[key] = value
        else:
            values.append((key, value))
    choices.update(cli_choices)
    # The experiment's `override /group: option` entries, unless the command line chose the group.
    exp_file = None
    if "experiment" in choices:
        exp_file = _option_file(dirs, "experiment", choices["experiment"])
        header, exp_data = _load_yaml(exp_file)
        if header != "_global_" or not isinstance(exp_data, dict):
            raise Unsupported("experiment header")
        for e in exp_data.get("defaults", []) or []:
            if e == "_self_":
                continue
            if not isinstance(e, dict) or len(e) != 1:
                raise Unsupported("experiment defaults")
            (k, o), = e.items()
            if not (isinstance(k, str) and k.startswith("override /") and isinstance(o, str)):
                raise Unsupported("experiment defaults")
            g = k[len("override /"):].strip()
            if g not in choices or g == "experiment":
                raise Unsupported("experiment defaults")
            if g not in cli_choices:
                choices[g] = o
    tree = _copy_tree(_default_tree())
    hints = _info(ExperimentConfig)
    for g in groups:
        if g == "experiment":
            _, data = _load_yaml(exp_file)  # type: ignore[arg-type]
            data = {k: v for k, v in (data or {}).items() if k != "defaults"}
            _merge(tree, ExperimentConfig, data, "", trace, f"experiment={choices[g]}")
            continue
        f = _option_file(dirs, g, choices[g])
        header, data = _load_yaml(f)
        if header not in (None, g) or g not in hints:
            raise Unsupported(str(f))
        if isinstance(data, dict) and "defaults" in data:
            raise Unsupported(str(f))
        _merge(tree[g], hints[g][1], data, f"{g}.", trace, f"{g}={choices[g]}")
    for key, text in values:
        parts = key.split(".")
        cls: Any = ExperimentConfig
        node = tree
        for part in parts[:-1]:
            info = _info(cls)
            if part not in info or not info[part][2]:
                raise Unsupported(key)
            cls, node = info[part][1], node[part]
        info = _info(cls)
        leaf = parts[-1]
        if leaf not in info or info[leaf][2]:
            raise Unsupported(key)
        node[leaf] = _convert(parse_value(text), info[leaf][0], key, from_cli=True)
        if trace is not None:
            trace[key] = "the command line"
    return _build(ExperimentConfig, tree)
