"""Numeric ranges of config knobs: declared next to each field, checked in one place.

A numeric field is declared with :func:`ranged` instead of a bare default::

    lr: float = ranged(1e-5, gt=0)
    top_k: int = ranged(-1, ge=1, also=(-1,))   # -1 = off
    max_tokens_per_mb: int | str = ranged("auto", ge=1, also=("auto",))   # a number, or the word auto

and :func:`check_ranges` walks a config (any group's dataclass, nested groups included) and raises
a :class:`ConfigError` naming the dotted path, the value and the range for the first value outside
its range. ``areal validate-config`` (``plan.validate.validate``) calls it before any other rule,
and ``validate_algo_config`` calls it on the ``algo`` group, so a bad number is reported as out of
range rather than as whatever later rule it happens to break. ``None`` is always allowed for an
``Optional`` field (it means "unset"); NaN and infinities are never in range. Import-light (no torch).

A unit test walks every int/float field of every group and fails when one has no declared range.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any

from areal_cli.errors import ConfigError

_META = "areal_range"


@dataclass(frozen=True)
class Range:
    """``lo``/``hi`` bounds (None = unbounded; ``*_open`` excludes the bound) plus special values."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float | str, ...] = ()  # a word here (``auto``) is what an ``int | str`` field may say instead
    why: str = ""  # what the range means, for the hint

    def contains(self, v: float | str) -> bool:
        if v in self.also:
            return True
        if isinstance(v, str):
            return False
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        text = f"{left}{lo}, {hi}{right}"
        if self.also:
            text = " or ".join([*(a if isinstance(a, str) else _num(a) for a in self.also), text])
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, also: tuple[float | str, ...] = (), why: str = "") -> Any:
    """A dataclass field with ``default`` whose value must lie in the given range (or ``also``)."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise ValueError("give one lower bound (ge or gt) and one upper bound (le or lt)")
    r = Range(lo=gt if gt is not None else ge, hi=lt if lt is not None else le, lo_open=gt is not None,
              hi_open=lt is not None, also=tuple(also), why=why)
    if default is not None and not r.contains(default):
        raise ValueError(f"default {default!r} is outside its own range {r}")
    return dataclasses.field(default=default, metadata={_META: r})


def field_range(f: dataclasses.Field) -> Range | None:
    return f.metadata.get(_META)


def is_numeric_type(tp: Any) -> bool:
    """int / float / their Optional forms, and ``int | str`` (a number or a word its range allows, such as
    ``auto``); bool is not a number here."""
    if tp in (int, float):
        return True
    args = typing.get_args(tp)
    if set(args) == {int, str}:
        return True
    return bool(args) and type(None) in args and all(a in (int, float, type(None)) for a in args)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """``(dotted path, field, type)`` of every int/float field of dataclass ``cls``, nested ones too."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.extend(numeric_fields(tp, path + "."))
        elif is_numeric_type(tp):
            out.append((path, f, tp))
    return out


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Raise ConfigError for the first numeric value of ``cfg`` outside its declared range."""
    p = prefix + "." if prefix else ""
    for path, f, _ in numeric_fields(type(cfg), p):
        r = field_range(f)
        if r is None:
            continue
        obj = cfg
        for part in path[len(p):].split("."):
            obj = getattr(obj, part)
        if obj is None and _optional(f, cfg, path[len(p):]):
            continue
        if isinstance(obj, str) and obj in r.also:
            continue
        if isinstance(obj, bool) or not isinstance(obj, (int, float)):
            words = any(isinstance(a, str) for a in r.also)
            raise ConfigError(path, f"must be {'' if words else 'a number in '}{r}, got {obj!r}", _hint(path, f, r))
        if not r.contains(obj):
            err = ConfigError(path, f"{obj!r} is out of range: must be in {r}", _hint(path, f, r))
            err.out_of_range = (obj, r)  # compose.explain_range adds where the value came from
            raise err


def _optional(f: dataclasses.Field, cfg: Any, rel: str) -> bool:
    owner = cfg
    parts = rel.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return type(None) in typing.get_args(_hints(type(owner))[parts[-1]])


def _hint(path: str, f: dataclasses.Field, r: Range) -> str:
    # No schema default here: an experiment or group option may set another value, and naming the schema's
    # would mislead (compose.explain_range names the value in effect and where it came from).
    return range_hint(path, r)


def range_hint(path: str, r: Range) -> str:
    """The fix of an out-of-range error: the range and what it means."""
    return "; ".join(x for x in (f"set {path} in {r}", r.why) if x)
