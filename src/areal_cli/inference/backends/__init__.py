"""Inference backends behind one registry: each is one module (or package) of pure payload builders and
parsers (no I/O) plus its torch-free :class:`~areal_cli.inference.backends.base.InferenceBackendSpec`
``SPEC``; the lines below are the only place a built-in backend is listed.

The allocation parser, the validator, the memory estimator, the planner, the package check and the
launcher read the spec; the client calls the module (``base.INTERFACE``). A plugin adds a backend with
its own folder and one line in a module named in ``plugins=[...]``::

    INFERENCE_BACKENDS.declare("mine", "my_pkg.mine:SPEC")
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from areal_cli.inference.backends.base import CAPABILITY_MEMBERS, INTERFACE, InferenceBackendSpec
from areal_cli.registry import Registry, RegistrationError


def _check_spec(name: str, spec: Any, _requirements: Any) -> None:
    """Checked when the spec is first loaded: it is a spec for ``name`` and its module offers the client's
    interface (what each declared capability needs included)."""
    if not isinstance(spec, InferenceBackendSpec):
        raise RegistrationError(f"inference backend {name!r}: {spec!r} is not an InferenceBackendSpec")
    if spec.name != name:
        raise RegistrationError(f"inference backend {name!r}: its spec is named {spec.name!r}")
    module = importlib.import_module(spec.module)
    missing = [m for m in INTERFACE if not hasattr(module, m)]
    missing += [m for flag, members in CAPABILITY_MEMBERS.items() if getattr(module, flag, False)
                for m in members if not hasattr(module, m)]
    if missing:
        raise RegistrationError(f"inference backend {name!r}: {spec.module} lacks {', '.join(missing)} "
                                "(inference/backends/base.py:INTERFACE)")


INFERENCE_BACKENDS: Registry = Registry("inference backend", "allocation_mode.spec", check=_check_spec)
INFERENCE_BACKENDS.declare("sglang", "areal_cli.inference.backends.sglang:SPEC")
INFERENCE_BACKENDS.declare("vllm", "areal_cli.inference.backends.vllm:SPEC")
INFERENCE_BACKENDS.declare("hf", "areal_cli.inference.backends.hf:SPEC")
DEFAULT_BACKEND = "hf"  # a server record or plan part that names none


def backend_names() -> tuple[str, ...]:
    """Every registered inference backend, built-ins first, then plugins'."""
    return INFERENCE_BACKENDS.names()


def is_backend(name: object) -> bool:
    return name in INFERENCE_BACKENDS


def backend_spec(name: str | None, path: str = "allocation_mode.spec") -> InferenceBackendSpec:
    """The spec of ``name`` (``None``: the default backend); a ConfigError at ``path`` for an unknown one."""
    return INFERENCE_BACKENDS.entry(name or DEFAULT_BACKEND, path).load()


def imageless_backends(names) -> list[str]:
    """The backends among ``names`` whose servers do not carry a prompt's images (``InferenceBackendSpec.images``)."""
    return sorted({n for n in names if n and not backend_spec(n).images})


def get_backend(name: str) -> ModuleType:
    """The payload-builder module the client calls for backend ``name``."""
    return importlib.import_module(backend_spec(name, "allocation_mode").module)
