"""Name → implementation registries whose entries declare their requirements, and plugin loading.

Every part a config key selects by name (``algo.adv_estimator``, ``algo.policy_loss``,
``algo.loss_agg``, ``algo.kl_estimator``, ``workflow.reward``, ``workflow.name``) lives in one
:class:`Registry`. An entry is declared once and everything reads it: ``validate-config`` takes the
allowed names and the requirements (an estimator that needs a critic, a loss without advantages)
from it, and the trainer resolves the implementation from the same entry.

- Built-ins are declared in their concept's registry module by ``"module:attr"`` target, so
  validation knows them without importing torch; the target is imported on first use. The same
  class lists training engines (``engines.ENGINES``), inference backends
  (``inference.backends.INFERENCE_BACKENDS``), launchers and CLI commands; an engine's or backend's
  entry is its torch-free spec (``api/backend_spec.py``).
- Plugins use the registry's decorator on the object itself::

      @register_adv_estimator("my_adv", needs_values=False)
      def my_adv(*, rewards, loss_mask): ...

  and are named in the config: ``plugins=[my_pkg.my_adv]``. The CLI imports them before it
  validates, :func:`load_plugins` exports them in ``AREAL_PLUGINS``, and every process the run starts
  (torchrun ranks, the rollout worker, reward workers: they inherit the environment) imports them
  before its first registry lookup. Trainer ranks also import ``cfg.plugins`` when they read the
  config (``config/io.py``), for launchers that do not pass the environment on.

Functions in a registry with ``inputs`` are called with exactly the inputs they name: an input
outside the registry's set is refused when the function is registered (a typo in a parameter name),
and :meth:`Registry.call` refuses an input it does not know (a typo at the call site).

This module must stay free of torch: the CLI imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from areal_cli.errors import ConfigError

PLUGINS_ENV = "AREAL_PLUGINS"
S = TypeVar("S")


class RegistrationError(TypeError):
    """A declaration is malformed (unknown parameter, name taken); a plugin's import reports it
    as a ConfigError at ``plugins[i]``."""


@dataclasses.dataclass(frozen=True)
class NoRequirements:
    """Spec of a registry whose entries declare nothing."""


@dataclasses.dataclass
class Entry(Generic[S]):
    """One registered name: its implementation (an object, or a ``module:attr`` target imported on
    first use) and its declared requirements ``spec``."""

    name: str
    target: Any
    spec: S
    registry: Registry[S]
    _obj: Any = None
    _params: frozenset[str] | None = None

    def load(self) -> Any:
        if self._obj is None:
            obj = import_target(self.target) if isinstance(self.target, str) else self.target
            self.registry._check_object(self.name, obj, self.spec)
            self._obj = obj
        return self._obj

    @property
    def params(self) -> frozenset[str]:
        """The parameter names of the loaded function (cached: :meth:`Registry.call` is per micro-batch)."""
        if self._params is None:
            self._params = frozenset(inspect.signature(self.load()).parameters)
        return self._params


def import_target(target: str) -> Any:
    """``pkg.mod:attr`` (or ``pkg.mod.attr``) → the object."""
    mod, sep, attr = target.partition(":")
    if not sep:
        mod, _, attr = target.rpartition(".")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[S]):
    """Names of one kind (``kind``, selected by the config key ``config_path``) → entries.

    ``spec_cls`` is the dataclass of requirements an entry declares (keyword arguments of
    :meth:`declare` / :meth:`register`; an unknown one is a TypeError). ``inputs``: for function
    registries, the names a function may take as parameters (see :meth:`call`)."""

    def __init__(self, kind: str, config_path: str, spec_cls: type[S] = NoRequirements,  # type: ignore[assignment]
                 inputs: Iterable[str] | None = None, check: Callable[[str, Any, Any], None] | None = None):
        self.kind, self.config_path, self.spec_cls = kind, config_path, spec_cls
        self.inputs = frozenset(inputs) if inputs is not None else None
        self._check = check
        self._entries: dict[str, Entry[S]] = {}

    # ---------------------------------------------------------------- declaring
    def declare(self, name: str, target: Any, **requirements: Any) -> Entry[S]:
        """Add ``name`` → ``target`` (an object or a ``module:attr`` string) with its requirements."""
        try:
            spec = self.spec_cls(**requirements)
        except TypeError as e:
            fields = [f.name for f in dataclasses.fields(self.spec_cls)]  # type: ignore[arg-type]
            raise RegistrationError(f"{self.kind} {name!r}: {e}; requirements it may declare: {fields}") from None
        old = self._entries.get(name)
        if old is not None and not _same_target(old.target, target):
            raise RegistrationError(f"{self.kind} {name!r} is already registered (to {_describe(old.target)}); "
                             "pick another name")
        entry = Entry(name, target, spec, self)
        if not isinstance(target, str):
            self._check_object(name, target, spec)  # a plugin's mistakes surface when it is imported
        self._entries[name] = entry
        return entry

    def register(self, name: str, **requirements: Any) -> Callable[[Any], Any]:
        """Decorator form of :meth:`declare`; returns the object unchanged."""
        def deco(obj: Any) -> Any:
            self.declare(name, obj, **requirements)
            return obj
        return deco

    def _check_object(self, name: str, obj: Any, spec: S) -> None:
        if self.inputs is not None:
            check_parameters(self.kind, name, obj, self.inputs)
        if self._check is not None:
            self._check(name, obj, spec)

    # ---------------------------------------------------------------- reading
    def names(self) -> tuple[str, ...]:
        _import_env_plugins()
        return tuple(self._entries)

    def declared(self) -> tuple[str, ...]:
        """The names declared so far, without importing the plugins named in ``AREAL_PLUGINS`` first (the CLI's
        command table, read before any config is)."""
        return tuple(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def entry(self, name: str, path: str | None = None) -> Entry[S]:
        """The entry for ``name``; a :class:`ConfigError` at ``path`` listing the registered names."""
        _import_env_plugins()
        try:
            return self._entries[name]
        except KeyError:
            pass
        names = list(self._entries)
        match = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
        hint = f"did you mean '{match[0]}'? " if match else ""
        raise ConfigError(path or self.config_path, f"unknown {self.kind} {name!r}",
                          f"{hint}use one of: {', '.join(names)} (or register one in a module named "
                          "in plugins=[...])")

    def spec(self, name: str, path: str | None = None) -> S:
        return self.entry(name, path).spec

    def get(self, name: str) -> Any:
        """The implementation registered as ``name`` (imported on first use)."""
        return self.entry(name).load()

    def call(self, name: str, **inputs: Any) -> Any:
        """Call ``name``'s function with the inputs it names as parameters.

        Every input must be one of the registry's ``inputs`` (a misspelt keyword is a TypeError,
        not silently ignored); a function parameter without a default that is not passed is a
        TypeError from the call itself."""
        if self.inputs is not None:
            unknown = sorted(set(inputs) - self.inputs)
            if unknown:
                raise TypeError(f"{self.kind}: unknown input(s) {unknown}; known: {sorted(self.inputs)}")
        entry = self.entry(name)
        params = entry.params
        return entry.load()(**{k: v for k, v in inputs.items() if k in params})


def check_parameters(kind: str, name: str, fn: Any, allowed: frozenset[str]) -> None:
    """``fn``'s parameters are keyword-passable names out of ``allowed`` (no ``*args``/``**kwargs``,
    which would hide a misspelt input)."""
    if not callable(fn):
        raise RegistrationError(f"{kind} {name!r}: {fn!r} is not callable")
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise RegistrationError(f"{kind} {name!r}: parameter {p.name!r} of {_describe(fn)} must be a named "
                            f"parameter (no *args, **kwargs or positional-only); inputs: {sorted(allowed)}")
        if p.name not in allowed:
            match = difflib.get_close_matches(p.name, sorted(allowed), n=1, cutoff=0.6)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise RegistrationError(f"{kind} {name!r}: {_describe(fn)} takes {p.name!r}, which is not an input"
                            f"{hint}; inputs: {sorted(allowed)}")


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _same_target(a: Any, b: Any) -> bool:
    # A module imported twice (``python -m x`` runs it as __main__ too, tests re-import) registers
    # equal objects again; that is not a clash.
    return a is b or _describe(a) == _describe(b)


# ---------------------------------------------------------------- plugins

_imported: set[str] = set()


def load_plugins(modules: Iterable[str], path: str = "plugins") -> None:
    """Import each plugin module (each registers its entries) and export the list in
    ``AREAL_PLUGINS`` so the processes this one starts import them too.

    A module that cannot be found is a :class:`ConfigError` at ``plugins[i]``."""
    modules = [str(m) for m in modules]
    for i, mod in enumerate(modules):
        _import_plugin(mod, f"{path}[{i}]")
    if modules:
        known = [m for m in os.environ.get(PLUGINS_ENV, "").split(",") if m]
        os.environ[PLUGINS_ENV] = ",".join(dict.fromkeys(known + modules))


def _import_plugin(mod: str, path: str) -> None:
    if mod in _imported:
        return
    if not mod or not all(part.isidentifier() for part in mod.split(".")):
        raise ConfigError(path, f"{mod!r} is not a module name", "name a module: plugins=[my_pkg.my_module]")
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod == e.name or mod.startswith(e.name + ".")):
            raise  # the plugin exists and one of *its* imports is missing: its own traceback says which
        raise ConfigError(path, f"cannot import plugin module {mod!r} ({e})",
                          "install it, or put its directory on PYTHONPATH (the run's processes inherit it)"
                          ) from e
    except RegistrationError as e:
        raise ConfigError(path, f"plugin module {mod!r} registers a malformed entry: {e}",
                          "fix the declaration in the plugin (docs/architecture.md, \"Registries and plugins\")"
                          ) from e
    _imported.add(mod)


def _import_env_plugins() -> None:
    for mod in os.environ.get(PLUGINS_ENV, "").split(","):
        if mod and mod not in _imported:
            _import_plugin(mod, PLUGINS_ENV)
