"""Pre-launch package check: the Python packages the chosen engine, inference backends and launcher need.

What a config selects, and what that needs (the extra that brings it, docs/install.md):

- any built-in ``engine.name``: torch (a base dependency; ``bash scripts/install.sh``);
- ``engine.name=megatron``: megatron-core, import name ``megatron.core`` (``areal-cli[megatron]``);
- ``engine.name=deepspeed``: deepspeed (``areal-cli[deepspeed]``);
- an ``sglang`` component in ``allocation_mode``: sglang (``areal-cli[sglang]``);
- a ``vllm`` component: vllm, in the interpreter that runs it (``scripts/setup_vllm_env.sh`` on CPU);
- an ``hf`` component: nothing, the server is built in;
- ``launcher.name=slurm``: submitit (base); ``ray``: ray (``areal-cli[ray]``); ``skypilot``: sky, here or
  in the SkyPilot venv the launcher looks for.

vLLM runs under its own interpreter (``$AREAL_VLLM_PYTHON``, else ``.venv-vllm``, else this one:
:func:`areal_cli.inference.backends.vllm.vllm_python`, its spec's ``python``), so that interpreter is the one
asked. Each engine's and backend's package is declared in its spec (``package``). A workflow or engine
named by import path is not checked here: it is imported by name where it runs (the validator already
imports an engine class named that way).

Refuse or warn. A missing package refuses (:class:`ConfigError`: the config path, the reason with this
Python's path, the fix) only when the plan runs *here*: ``launcher.name=local`` with a ``cluster.device``
this machine has (cpu always; cuda when an NVIDIA driver is loaded: :mod:`areal_cli.config.where`), on one
node (``cluster.n_nodes=1``). Then every process of the run starts from this Python, so ``areal validate-config``,
``areal train --dry-run`` and ``areal train`` refuse alike, before any server starts. Any other plan is
made here and run elsewhere (a SLURM/Ray/SkyPilot cluster, several nodes, a GPU plan drafted on a laptop):
the packages are needed on the nodes, not here, so each missing one becomes a plan warning and validation
goes on. The launcher's own package (ray, sky) is needed here at ``areal train``; its preflight refuses
then, so validation only warns about it.

No package is imported: :func:`importlib.util.find_spec` finds it on the path (a submodule is looked up
inside its parent's directories, so not even a namespace parent is imported). That costs well under a
millisecond per package; a separate vLLM interpreter costs one ``python -c`` of its own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

INSTALL_SH = "bash scripts/install.sh"


@dataclass(frozen=True)
class Need:
    """One package the config selects: where it is selected, and how to get it."""

    path: str  # the config path that selects it
    module: str  # import name, dotted for a submodule (megatron.core)
    dist: str  # the name pip knows
    fix: str


def _extra(name: str) -> str:
    return f"pip install 'areal-cli[{name}]' (or AREAL_EXTRAS={name} {INSTALL_SH})"


TORCH = Need("engine.name", "torch", "torch", f"{INSTALL_SH} (the CPU build; AREAL_TORCH=cuda on GPU nodes)")


class _SpecNeeds(Mapping):
    """``backend -> Need`` read from each registered backend's spec (its ``package``), so a backend's package is
    declared once, in its own folder."""

    def __init__(self, path: str, names: Callable[[], tuple[str, ...]], spec: Callable[[str], Any]):
        self.path, self._names, self._spec = path, names, spec

    def __getitem__(self, name: str) -> Need:
        pkg = self._spec(name).package if name in self._names() else None
        if pkg is None:
            raise KeyError(name)
        return Need(self.path, pkg.module, pkg.dist, pkg.fix)

    def __iter__(self) -> Iterator[str]:
        return iter(n for n in self._names() if self._spec(n).package is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _engine_spec(name: str) -> Any:
    from areal_cli.engines import get_engine_spec

    return get_engine_spec(name)


def _engine_names() -> tuple[str, ...]:
    from areal_cli.engines import engine_names

    return engine_names()


def _backend_spec(name: str) -> Any:
    from areal_cli.inference.backends import backend_spec

    return backend_spec(name)


def _backend_names() -> tuple[str, ...]:
    from areal_cli.inference.backends import backend_names

    return backend_names()


ENGINE_NEEDS: Mapping[str, Need] = _SpecNeeds("engine.name", _engine_names, _engine_spec)
BACKEND_NEEDS: Mapping[str, Need] = _SpecNeeds("allocation_mode.spec", _backend_names, _backend_spec)
LAUNCHER_NEEDS = {
    "slurm": Need("launcher.name", "submitit", "submitit", f"pip install submitit (a base dependency: {INSTALL_SH})"),
    "ray": Need("launcher.name", "ray", "ray", _extra("ray") + "; the same Ray version as the cluster"),
    "skypilot": Need("launcher.name", "sky", "skypilot",
                     "pip install 'areal-cli[skypilot]' in its own venv and set AREAL_SKYPILOT_PYTHON to its python"),
}


def findable(module: str) -> bool:
    """Whether ``module`` (dotted for a submodule) can be imported from this Python, importing nothing."""
    head, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(head)
    except (ImportError, ValueError):  # ValueError: already imported without a __spec__, so it is there
        return head in sys.modules
    for part in rest.split(".") if rest else ():
        locations = spec.submodule_search_locations if spec is not None else None
        if not locations:
            return False
        head = f"{head}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(head, list(locations))
    return spec is not None


_PROBE = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"


def findable_in(python: str, module: str) -> bool:
    """``findable`` for another interpreter (a top-level module): one short ``python -c`` of its own."""
    # abspath, not realpath: a venv's python is a symlink to the base interpreter, yet sees other packages
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return findable(module)
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return False
    try:
        probe = subprocess.run([python, "-c", _PROBE, module], check=False, capture_output=True, timeout=60)
        return probe.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def runs_here(cfg: ExperimentConfig) -> bool:
    """Every process of the plan starts from this Python: config/where.py's rule (local launcher, a device this
    machine has), on one node: a multi-node plan's other hosts have environments of their own."""
    from areal_cli.config.where import runs_here as launches_here

    return launches_here(cfg) and int(cfg.cluster.n_nodes) == 1


def _skypilot_present() -> bool:
    from areal_cli.launchers.skypilot import SKY_VENV_PYTHON

    cand = os.path.expanduser(os.environ.get("AREAL_SKYPILOT_PYTHON", SKY_VENV_PYTHON))
    return findable("sky") or (os.path.isfile(cand) and os.access(cand, os.X_OK))


def missing(cfg: ExperimentConfig, backends: list[str]) -> list[tuple[Need, str]]:
    """``(need, the interpreter it is missing from)`` for each package the config selects and this machine
    lacks; ``backends`` are the inference backends of the plan."""
    out: list[tuple[Need, str]] = []
    here = sys.executable
    engine = cfg.engine.name
    if ":" not in engine:  # built-in engines all train with torch; an import-path engine imported itself
        for need in (TORCH, ENGINE_NEEDS.get(engine)):
            if need is not None and not findable(need.module):
                out.append((need, here))
    for backend in sorted(set(backends)):
        need = BACKEND_NEEDS.get(backend)
        if need is None:
            continue
        own_python = _backend_spec(backend).python  # a backend that runs under its own interpreter (vLLM)
        python = own_python() if own_python is not None else here
        if not findable_in(python, need.module):
            out.append((need, python))
    need = LAUNCHER_NEEDS.get(cfg.launcher.name)
    if need is not None:
        present = _skypilot_present() if need.dist == "skypilot" else findable(need.module)
        if not present:
            out.append((need, here))
    return out


def _reason(cfg: ExperimentConfig, need: Need, python: str) -> str:
    what = {"engine.name": f"engine={cfg.engine.name}", "launcher.name": f"launcher={cfg.launcher.name}"}
    who = what.get(need.path, f"the {need.dist} inference backend")
    where = "this Python" if python == sys.executable else "the interpreter that runs it"
    return f"{who} needs {need.dist}, which is not installed in {where} ({python})"


def check_packages(cfg: ExperimentConfig, plan: Any) -> None:
    """Refuse (ConfigError) a plan that runs here without its packages; warn when it runs elsewhere."""
    lacking = missing(cfg, [p.backend for p in plan.inferences])
    if not lacking:
        return
    if runs_here(cfg):  # launcher=local: every need is an engine's or a backend's
        need, python = lacking[0]
        raise ConfigError(need.path, _reason(cfg, need, python), need.fix)
    for need, python in lacking:
        where = ("needed here at `areal train`" if need.path == "launcher.name"
                 else "the nodes that run this plan need it")
        plan.warnings.append(f"{need.path}: {_reason(cfg, need, python)}; {where} — fix: {need.fix}")
