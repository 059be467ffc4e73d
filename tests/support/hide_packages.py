"""Make installed packages look not installed: every import finder on ``sys.meta_path`` is wrapped so that
it answers "no such module" for the hidden top-level names (and their submodules), as Python does for a
package that is absent. ``import megatron`` then raises ModuleNotFoundError and
``importlib.util.find_spec("megatron")`` returns None, in this process and, through ``sitecustomize``, in
every Python process started with :func:`sitecustomize_env`.

Used by the package-check tests (tests/unit/config/test_packages_check.py,
tests/integration/cli/test_packages_cli.py): this machine has megatron-core and deepspeed installed, a new
user's machine does not.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ENV = "AREAL_TEST_HIDE_PACKAGES"


class _Hiding:
    def __init__(self, inner, hidden: frozenset[str]):
        self._inner, self._hidden = inner, hidden

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self._hidden:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self._inner, attr)


def install(names) -> list:
    """Hide ``names`` (top-level import names) from imports; returns the previous ``sys.meta_path``."""
    hidden = frozenset(n for n in names if n)
    before = list(sys.meta_path)
    sys.meta_path[:] = [_Hiding(f, hidden) for f in before]
    return before


def sitecustomize_env(tmp_dir: Path, names, env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python processes start with ``names`` hidden (a ``sitecustomize`` on PYTHONPATH)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(__file__, tmp_dir / "sitecustomize.py")
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_dir), env.get("PYTHONPATH")) if p)
    env[ENV] = ",".join(names)
    return env


if __name__ == "sitecustomize":
    install(os.environ.get(ENV, "").split(","))
