"""Recursive-descent parser for the ``allocation_mode`` language.

Grammar (whitespace around the whole spec is ignored, inside it is an error)::

    spec      := group ('+' group)*
    group     := component ('|' component)*          # '|' colocates parts on the same devices
    component := [backend ['[' name ']'] ('.'|':')] body
    body      := dims | '(' 'attn' ':' dims '|' 'ffn' ':' dims ')'   # hybrid MoE (engines with hybrid_moe)
    dims      := (letter int)+   letter in d t p c e, each at most once

Every error is a :class:`ConfigError` on ``allocation_mode.spec`` carrying the text and the
column of the offending character, so the CLI can draw a caret under it.
"""

from __future__ import annotations

from areal_cli.allocation.spec import (
    DIM_LETTERS,
    DIM_NAMES,
    AllocationSpec,
    Component,
    Dims,
    inference_backends,
    train_backends,
)
from areal_cli.engines import engines_with, get_engine_spec
from areal_cli.errors import ConfigError, did_you_mean
from areal_cli.inference.backends import backend_spec

SPEC_PATH = "allocation_mode.spec"
MAX_DIM = 65536
EXAMPLE = "sglang:d4+fsdp:d4"
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
UNSPECIFIED_TRAIN_DIMS = "dtpce"  # checked against the engine once it is known


def backend_dims(backend: str, kind: str | None = None) -> str:
    """The dims ``backend`` can express, from its registry entry (inference parts never use c)."""
    if kind == "inference" or (kind is None and backend in inference_backends()):
        return backend_spec(backend).dims
    return get_engine_spec(backend).dims


def _hybrid_default() -> str:
    """The engine a bare hybrid body ``(attn:…|ffn:…)`` is checked against until the engine is known."""
    capable = engines_with("hybrid_moe")
    return capable[0] if capable else ""


class _Parser:
    def __init__(self, text: str):
        self.raw = text
        stripped = text.strip()
        self.offset = len(text) - len(text.lstrip())
        self.s = stripped
        self.i = 0

    # --- helpers -------------------------------------------------------------------------
    def error(self, reason: str, hint: str, col: int | None = None) -> ConfigError:
        col = self.i if col is None else col
        return ConfigError(SPEC_PATH, reason, hint, text=self.raw, column=self.offset + col)

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def describe(self) -> str:
        ch = self.peek()
        return f"unexpected '{ch}' at column {self.offset + self.i}" if ch else "unexpected end of spec"

    def expect(self, ch: str, what: str) -> None:
        if self.peek() != ch:
            raise self.error(f"{self.describe()}, expected '{ch}' {what}", f"write e.g. {EXAMPLE}")
        self.i += 1

    def word(self) -> str:
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isascii() and self.s[self.i].isalpha()
                                        or self.s[self.i] == "_"):
            self.i += 1
        return self.s[start:self.i]

    # --- grammar -------------------------------------------------------------------------
    def parse(self) -> AllocationSpec:
        if not self.s:
            raise ConfigError(SPEC_PATH, "the allocation spec is empty",
                              f"set allocation_mode=local_cpu or a spec such as {EXAMPLE}",
                              text=self.raw, column=0)
        comps: list[Component] = []
        group = 0
        while True:
            comps.append(self.component(group))
            ch = self.peek()
            if ch == "+":
                group += 1
            elif ch != "|":
                break
            self.i += 1
            if not self.peek():
                raise self.error(f"spec ends after '{ch}'", "add a component after it or remove the "
                                 f"trailing '{ch}'")
        if self.i < len(self.s):
            ch = self.peek()
            hint = ("spaces are not allowed inside a spec" if ch.isspace() else
                    "separate components with '+' (or '|' to colocate them)")
            raise self.error(f"{self.describe()}", hint)
        return AllocationSpec(text=self.raw, components=comps)

    def component(self, group: int) -> Component:
        start = self.i
        if self.peek() == "(":
            return self.hybrid(None, None, start, group)
        w = self.word()
        nxt = self.peek()
        if w and (nxt in "[.:" and nxt):
            backend = self.backend(w, start)
            name = self.name() if self.peek() == "[" else None
            if self.peek() not in (".", ":") or not self.peek():
                raise self.error(f"{self.describe()}, expected '.' or ':' after the backend",
                                 f"write {backend}{'[' + name + ']' if name else ''}:d2")
            self.i += 1
            kind = "inference" if backend in inference_backends() else "train"
            if self.peek() == "(":
                return self.hybrid(backend, name, start, group)
            dims = self.dims(backend)
            return Component(kind, backend, name, dims, column=self.offset + start, group=group)
        # No backend: a bare dims body, which is a train part whose backend the engine supplies.
        self.i = start
        if w and w[0] not in DIM_LETTERS:
            raise self.error(f"unknown backend '{w}'", self._backend_hint(w), start)
        if not w:
            raise self.error(f"{self.describe()}, expected a component",
                             f"a component is backend:dims or bare dims, e.g. {EXAMPLE} or d4t2")
        dims = self.dims(None)
        return Component("train", None, None, dims, column=self.offset + start, group=group)

    def _digit_after_letter(self) -> bool:
        return self.i + 1 < len(self.s) and self.s[self.i + 1].isdigit()

    def _backend_hint(self, w: str) -> str:
        inference, train = inference_backends(), train_backends()
        return (f"{did_you_mean(w.lower(), inference + train)}inference backends: {', '.join(inference)}; "
                f"train backends: {', '.join(train)}")

    def backend(self, w: str, start: int) -> str:
        if w not in inference_backends() and w not in train_backends():
            raise self.error(f"unknown backend '{w}'", self._backend_hint(w), start)
        return w

    def name(self) -> str:
        self.i += 1  # '['
        start = self.i
        while self.peek() and self.peek() in NAME_CHARS:
            self.i += 1
        name = self.s[start:self.i]
        if self.peek() != "]":
            if not self.peek():
                raise self.error("unclosed '[' in a component name", "close the name: backend[name]:dims",
                                 start - 1)
            raise self.error(f"{self.describe()} in a component name",
                             "names use letters, digits, '_' and '-'")
        if not name:
            raise self.error("empty component name '[]'", "write a name such as fsdp[actor]:d4 or drop "
                             "the brackets", start - 1)
        self.i += 1
        return name

    def hybrid(self, backend: str | None, name: str | None, start: int, group: int) -> Component:
        open_col = self.i
        if backend is not None and (backend in inference_backends() or not get_engine_spec(backend).hybrid_moe):
            capable = engines_with("hybrid_moe")
            raise self.error(f"the hybrid MoE form (attn:…|ffn:…) is only supported by {', '.join(capable)}, not "
                             f"'{backend}'", f"use {capable[0] if capable else '<engine>'}:(attn:d4p2t2c2|ffn:d2p2t4e2) "
                             "or plain dims", open_col)
        self.i += 1
        parts: dict[str, Dims] = {}
        for key, sep in (("attn", "|"), ("ffn", ")")):
            kcol = self.i
            w = self.word()
            if w != key:
                shown = f"'{w}'" if w else self.describe()
                raise self.error(f"expected '{key}:' in the hybrid MoE form, found {shown}",
                                 "write (attn:d4p2t2c2|ffn:d2p2t4e2)", kcol)
            self.expect(":", f"after '{key}'")
            parts[key] = self.dims(backend or _hybrid_default() or None, part=key)
            if self.peek() != sep:
                if not self.peek() and sep == ")":
                    raise self.error("unclosed '(' in the hybrid MoE form", "close it with ')'", open_col)
                raise self.error(f"{self.describe()}, expected '{sep}'",
                                 "write (attn:d4p2t2c2|ffn:d2p2t4e2)")
            self.i += 1
        return Component("train", backend, name, parts["attn"], ffn=parts["ffn"],
                         column=self.offset + start, group=group)

    def dims(self, backend: str | None, part: str | None = None) -> Dims:
        dims = Dims()
        given: list[str] = []
        if not self.peek() or not self.peek().isalpha():
            raise self.error(f"{self.describe()}, expected dims such as d4 or d2t2p2",
                             "dims are letters d t p c e each followed by a size")
        while self.peek().isalpha():
            col = self.i
            letter = self.peek()
            if letter not in DIM_LETTERS:
                raise self.error(f"unknown dimension '{letter}'",
                                 "dims are d (data), t (tensor), p (pipeline), c (context), e (expert)")
            if letter in given:
                raise self.error(f"dimension '{letter}' given twice", f"write {letter} once", col)
            self.i += 1
            nstart = self.i
            while self.peek().isdigit():
                self.i += 1
            digits = self.s[nstart:self.i]
            if not digits:
                raise self.error(f"dimension '{letter}' has no size", f"write e.g. {letter}2", col)
            value = int(digits)
            if value < 1:
                raise self.error(f"dimension '{letter}' must be at least 1, got {value}",
                                 f"use {letter}1 or drop it", nstart)
            if value > MAX_DIM:
                raise self.error(f"dimension '{letter}{value}' is larger than {MAX_DIM}",
                                 "use a realistic size", nstart)
            self._check_dim_allowed(backend, part, letter, value, col)
            setattr(dims, letter, value)
            dims.span[letter] = self.offset + col
            given.append(letter)
        dims.given = tuple(given)
        return dims

    def _check_dim_allowed(self, backend: str | None, part: str | None, letter: str, value: int,
                           col: int) -> None:
        if value == 1:
            return
        if part == "attn" and letter == "e":
            raise self.error("the attn part of the hybrid form cannot use e",
                             "put expert parallelism in the ffn part", col)
        if part == "ffn" and letter == "c":
            raise self.error("the ffn part of the hybrid form cannot use c",
                             "put context parallelism in the attn part", col)
        if backend is None:
            return
        allowed = backend_dims(backend)
        if letter not in allowed:
            what = DIM_NAMES[letter]
            if backend in inference_backends():
                hint = backend_spec(backend).dims_fix(letter, value)
            else:
                hint = (f"drop {letter}{value} or pick a backend that supports {what} parallelism "
                        f"({', '.join(b for b in train_backends() if letter in backend_dims(b, 'train'))})")
            raise self.error(f"{backend} does not support {what} parallelism ({letter}{value})", hint, col)


def _structure(spec: AllocationSpec) -> None:
    """Checks that need only the spec: names, colocation, backend mixing."""
    comps = spec.components

    def err(c: Component, reason: str, hint: str) -> ConfigError:
        return ConfigError(SPEC_PATH, reason, hint, text=spec.text, column=c.column)

    seen: dict[str, Component] = {}
    for c in comps:
        if c.name is not None:
            if c.name in seen:
                raise err(c, f"duplicate component name '{c.name}'", "give every component its own name")
            seen[c.name] = c
    for kind in ("inference", "train"):
        same = [c for c in comps if c.kind == kind]
        if len(same) > 1:
            for c in same:
                if c.name is None:
                    raise err(c, f"{len(same)} {kind} components need names to tell them apart",
                              f"name each one, e.g. {c.backend or 'fsdp'}[{'gen' if kind == 'inference' else 'actor'}]"
                              f":{c.dims_text()}")
    backends = {c.backend for c in spec.train if c.backend}
    if len(backends) > 1:
        c = spec.train[-1]
        raise err(c, f"train components use different backends ({', '.join(sorted(backends))})",
                  "use one train backend for all train components")
    for group in spec.groups:
        if len(group) < 2:
            continue
        members = [comps[i] for i in group]
        if sum(c.kind == "inference" for c in members) > 1:
            c = [c for c in members if c.kind == "inference"][1]
            raise err(c, "two inference components are colocated with '|'",
                      "colocate at most one inference part with train parts; separate others with '+'")
        w0 = members[0].world_size
        for c in members[1:]:
            if c.world_size != w0:
                raise err(c, f"colocated components need the same number of devices: "
                          f"'{members[0].label}' uses {w0}, '{c.label}' uses {c.world_size}",
                          "make the products of their dims equal, e.g. vllm:d2t2|fsdp:d4")


def parse_allocation(text: str) -> AllocationSpec:
    """Parse ``text`` into an :class:`AllocationSpec` or raise a ConfigError with a caret."""
    if not isinstance(text, str):
        raise ConfigError(SPEC_PATH, f"expected a string, got {type(text).__name__}",
                          f"write e.g. {EXAMPLE}")
    spec = _Parser(text).parse()
    _structure(spec)
    return spec
