"""Training backends behind one registry: one :class:`EngineSpec` per backend, listed below by name.

Each spec lives with its backend (``engines/megatron/__init__.py``, ``engines/archon/__init__.py``; the
single-module fsdp and deepspeed engines in ``engines/specs.py``) and is the one place that says what the
backend is: the allocation parser reads its dims, the validator its dims, config section and capabilities
(``lora``, ``routing_replay``, ``hybrid_moe``, ...), the memory estimator its sharding model, the package check
its package, and the trainer its class. Import-light: no torch here, so the CLI can validate without it; the
class is imported only when a trainer process builds the engine.

A plugin adds a backend with its own folder and one line in a module named in ``plugins=[...]``::

    ENGINES.declare("mine", "my_pkg.mine:SPEC")

(the trainer's child processes import the plugin modules too: ``registry.load_plugins``). A class outside
any registry can still be named by import path, ``engine.name=pkg.module:Class``; it may declare ``dims``
(the allocation dims it runs, default ``"d"``).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from importlib import import_module
from typing import Any

from areal_cli.api.backend_spec import FULL_SHARD, EngineSpec, Sharding  # noqa: F401  (re-exported)
from areal_cli.errors import ConfigError
from areal_cli.registry import RegistrationError, Registry


def _check_spec(name: str, spec: Any, _requirements: Any) -> None:
    if not isinstance(spec, EngineSpec):
        raise RegistrationError(f"training engine {name!r}: {spec!r} is not an EngineSpec")
    if spec.name != name:
        raise RegistrationError(f"training engine {name!r}: its spec is named {spec.name!r}")


ENGINES: Registry = Registry("training engine", "engine.name", check=_check_spec)
ENGINES.declare("fsdp", "areal_cli.engines.specs:FSDP")
ENGINES.declare("megatron", "areal_cli.engines.megatron:SPEC")
ENGINES.declare("archon", "areal_cli.engines.archon:SPEC")
ENGINES.declare("deepspeed", "areal_cli.engines.specs:DEEPSPEED")
DEFAULT_ENGINE = "fsdp"
BUILTIN_ENGINES = tuple(ENGINES._entries)  # the lines above, before any plugin adds its own


class _SpecView(MutableMapping):
    """``name -> EngineSpec`` over :data:`ENGINES` (built-ins and plugins), for readers that want a mapping."""

    def __getitem__(self, name: str) -> EngineSpec:
        if name not in ENGINES:
            raise KeyError(name)
        return ENGINES.get(name)

    def __setitem__(self, name: str, spec: EngineSpec) -> None:
        ENGINES.declare(name, spec)

    def __delitem__(self, name: str) -> None:
        ENGINES._entries.pop(name)

    def __iter__(self) -> Iterator[str]:
        return iter(ENGINES.names())

    def __len__(self) -> int:
        return len(ENGINES.names())


ENGINE_SPECS: MutableMapping[str, EngineSpec] = _SpecView()


def engine_names() -> tuple[str, ...]:
    """Every registered training engine, built-ins first, then plugins'."""
    return ENGINES.names()


def engines_with(capability: str) -> list[str]:
    """Registered engines whose spec declares ``capability`` (a truthy field), the default engine first, then
    by name: the list a refusal offers instead."""
    names = [n for n in ENGINES.names() if getattr(ENGINES.get(n), capability)]
    return sorted(names, key=lambda n: (n != DEFAULT_ENGINE, n))


def is_import_path(name: str) -> bool:
    return ":" in name and all(part.strip() for part in name.split(":", 1))


def get_engine_spec(name: str) -> EngineSpec:
    """The spec for a built-in backend name or a ``pkg.module:Class`` import path."""
    if name in ENGINES:
        return ENGINES.get(name)
    if is_import_path(name):
        cls = _import_class(name)
        return EngineSpec(name, name, str(getattr(cls, "dims", "d")), lambda _: FULL_SHARD, None,
                          (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "")
    from areal_cli.errors import did_you_mean

    raise ConfigError("engine.name", f"unknown training engine {name!r}",
                      f"{did_you_mean(name, engine_names())}use one of: {', '.join(engine_names())}, "
                      "or a TrainEngine subclass as pkg.module:Class")


def engine_dims(name: str) -> str:
    return get_engine_spec(name).dims


def trainable_engines() -> list[str]:
    return [n for n in ENGINES.names() if ENGINES.get(n).trainable]


def get_engine_cls(name: str):
    """The TrainEngine subclass for ``name``; a typed error for a planned or unknown backend."""
    spec = get_engine_spec(name)
    if spec.target is None:
        raise ConfigError("engine.name", f"the {name!r} training backend is validated and planned "
                          "(validate-config, train --dry-run) but cannot train in this release",
                          f"train with engine={' or engine='.join(trainable_engines())}")
    return _import_class(spec.target)


def _import_class(target: str):
    from areal_cli.api.engine_api import TrainEngine

    mod, _, attr = target.partition(":")
    try:
        cls = getattr(import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError("engine.name", f"cannot import the training engine {target!r} ({e})",
                          "check the module path and that the package is installed in this environment") from None
    if not (isinstance(cls, type) and issubclass(cls, TrainEngine)):
        raise ConfigError("engine.name", f"{target!r} is not a TrainEngine subclass",
                          "point engine.name at a class that implements areal_cli.api.engine_api.TrainEngine")
    return cls
