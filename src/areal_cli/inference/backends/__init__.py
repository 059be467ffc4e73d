"""Pure payload builders/parsers per server backend (no I/O): ``sglang``, ``vllm``, ``hf``."""

from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = ("hf", "sglang", "vllm")


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        from areal_cli.errors import ConfigError

        raise ConfigError("allocation_mode", f"unknown inference backend {name!r}", f"use one of {BACKENDS}")
    return importlib.import_module(f"areal_cli.inference.backends.{name}")
