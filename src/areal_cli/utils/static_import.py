"""Whether a ``module:attr`` (or ``pkg.module.attr``) config target exists, without running the module.

``validate-config`` must stay torch-free and fast, and the modules a config names (reward functions,
workflows, agents) usually import torch or an agent framework. So the module is located with
``importlib.util.find_spec`` (which imports its parent packages only) and the attribute is looked up
among the module's top-level names, read from its source with ``ast``. A module that is already imported
is asked directly. Where the source cannot tell (a compiled module, a module-level ``__getattr__``, a
star import) the check passes, and the process that runs the target resolves it as before.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
import pkgutil
import sys
from typing import Any

from areal_cli.errors import ConfigError, did_you_mean

UNDECIDED = object()  # the target's module exists, but its source cannot say whether the attribute does


def split_target(target: str) -> tuple[str, str]:
    """``pkg.mod:attr`` or ``pkg.mod.attr`` → ``("pkg.mod", "attr")`` (either part may be empty)."""
    if ":" in target:
        mod, _, attr = target.partition(":")
    else:
        mod, _, attr = target.rpartition(".")
    return mod, attr


def find_target(target: str, config_path: str) -> Any:
    """The target's definition: its ``ast`` node (``FunctionDef``, ``ClassDef``, ...) when read from source,
    the object when its module is already imported, or :data:`UNDECIDED`. A module that cannot be found
    or an attribute it does not define is a :class:`ConfigError` at ``config_path``."""
    mod, attr = split_target(target)
    if not mod or not attr:
        raise ConfigError(config_path, f"{target!r} is not an import path",
                          "use package.module:name (or package.module.name)")
    head = attr.split(".")[0]
    if mod in sys.modules:
        module = sys.modules[mod]
        if hasattr(module, head):
            return getattr(module, head)
        raise _no_attr(config_path, mod, head, [n for n in vars(module) if not n.startswith("_")])
    origin = _module_origin(mod, config_path)
    if origin is None or not origin.endswith(".py"):
        return UNDECIDED
    try:
        st = os.stat(origin)
        names, dynamic = _module_names(origin, st.st_mtime_ns, st.st_size)
    except (OSError, SyntaxError, ValueError):
        return UNDECIDED  # importing it reports a syntax error with its own traceback
    if head in names:
        return names[head]
    if dynamic:
        return UNDECIDED
    raise _no_attr(config_path, mod, head, list(names))


@functools.lru_cache(maxsize=64)
def _module_names(origin: str, mtime_ns: int, size: int) -> tuple[dict[str, ast.AST], bool]:
    """:func:`top_level_names` of a source file, parsed once per version (sweeps validate many trials)."""
    with open(origin, encoding="utf-8") as f:
        return top_level_names(ast.parse(f.read(), filename=origin))


def _module_origin(mod: str, config_path: str) -> str | None:
    try:
        spec = importlib.util.find_spec(mod)
    except ModuleNotFoundError as e:
        spec, missing = None, e.name or mod
    except Exception as e:  # a parent package's __init__ failed: its own error says why
        raise ConfigError(config_path, f"importing the package of {mod!r} failed: {type(e).__name__}: {e}",
                          "fix that package, or check the path") from e
    else:
        missing = mod
    if spec is None:
        parent, _, leaf = missing.rpartition(".")
        siblings = _submodules(parent)
        raise ConfigError(config_path, f"no module named {missing!r}",
                          f"{did_you_mean(leaf, siblings)}check the spelling, and that it is installed or its "
                          "directory is on PYTHONPATH (the run's processes inherit it)")
    return spec.origin


def _submodules(parent: str) -> list[str]:
    if not parent:
        return []
    pkg = sys.modules.get(parent)
    paths = getattr(pkg, "__path__", None)
    return [m.name for m in pkgutil.iter_modules(paths)] if paths else []


def _no_attr(config_path: str, mod: str, attr: str, names: list[str]) -> ConfigError:
    return ConfigError(config_path, f"module {mod!r} has no attribute {attr!r}",
                       f"{did_you_mean(attr, names)}define {attr} in {mod}, or fix the path")


def top_level_names(tree: ast.Module) -> tuple[dict[str, ast.AST], bool]:
    """Names a module binds at import time → their defining node, and whether it may bind others
    (``from x import *``, a module ``__getattr__``)."""
    names: dict[str, ast.AST] = {}
    dynamic = False

    def bind(target: ast.AST, node: ast.AST) -> None:
        if isinstance(target, ast.Name):
            names[target.id] = node
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                bind(t, node)

    def walk(body: list[ast.stmt]) -> None:
        nonlocal dynamic
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
                dynamic |= node.name == "__getattr__"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    if a.name == "*":
                        dynamic = True
                    else:
                        names[a.asname or a.name.split(".")[0]] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    bind(t, node)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target, node)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    walk(getattr(node, block, []) or [])
                for h in getattr(node, "handlers", []):
                    walk(h.body)

    walk(tree.body)
    return names, dynamic


def parameters(found: Any) -> tuple[list[str], bool] | None:
    """(parameter names, takes ``**kwargs``) of a found callable or class constructor; ``None`` when
    the source cannot tell (a class inheriting its ``__init__``, an assignment)."""
    if isinstance(found, ast.ClassDef):
        init = next((n for n in found.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        return None if init is None else _ast_params(init, skip_first=True)
    if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _ast_params(found, skip_first=False)
    if found is UNDECIDED or isinstance(found, ast.AST):
        return None
    try:
        sig = inspect.signature(found)
    except (TypeError, ValueError):
        return None
    ps = list(sig.parameters.values())
    return ([p.name for p in ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)],
            any(p.kind is p.VAR_KEYWORD for p in ps))


def _ast_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, skip_first: bool) -> tuple[list[str], bool]:
    a = fn.args
    pos = [p.arg for p in a.posonlyargs + a.args]
    if skip_first and pos:
        pos = pos[1:]
    return pos + [p.arg for p in a.kwonlyargs], a.kwarg is not None


def is_sync_function(found: Any) -> bool:
    """True when the target is certainly a plain (not ``async``) function, or a class whose own
    ``__call__`` is plain: what an agent must not be."""
    if isinstance(found, ast.FunctionDef):
        return True
    if isinstance(found, ast.ClassDef):
        call = next((n for n in found.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == "__call__"), None)
        return isinstance(call, ast.FunctionDef)
    if inspect.isfunction(found):
        return not inspect.iscoroutinefunction(found)
    return False
