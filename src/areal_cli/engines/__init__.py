"""Training backends, looked up by name (``engine.name``).

Import-light: backends are imported only when asked for, so the CLI can list names without torch.
"""

from __future__ import annotations

from importlib import import_module

from areal_cli.errors import ConfigError

# name → "module:Class"; only registered backends that exist in this package are listed.
ENGINES: dict[str, str] = {
    "fsdp": "areal_cli.engines.fsdp:FSDPEngine",
}


def register_engine(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (used by other backends and plugins)."""
    ENGINES[name] = target


def get_engine_cls(name: str):
    """The TrainEngine subclass registered as ``name``."""
    target = ENGINES.get(name)
    if target is None:
        raise ConfigError("engine.name", f"unknown training engine {name!r}",
                          f"use one of: {', '.join(sorted(ENGINES))}")
    mod, cls = target.split(":")
    return getattr(import_module(mod), cls)
