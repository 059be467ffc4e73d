"""Config group names, the config search path and each group's options (directory scans, no imports).

The packaged ``conf/`` (the repository's top-level ``conf/``, shipped in the wheel as ``areal_cli/conf``)
is always on the search path. ``--config-dir DIR`` (Hydra's convention) puts a user's own directory in
front of it: ``DIR/experiment/my_run.yaml`` or ``DIR/model/my_model.yaml`` become options of their groups
without copying the package. The directories travel in ``AREAL_CONFIG_DIR`` (``os.pathsep``-separated),
so the processes a run or a sweep starts see the same options. A user file may not reuse a packaged
option's name: with two files behind one name, which one a run used would depend on the search order.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_cli.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
CONFIG_DIR_ENV = "AREAL_CONFIG_DIR"
GROUPS = ("algo", "engine", "allocation_mode", "workflow", "launcher", "model", "dataset", "cluster",
          "rollout", "experiment")


def user_config_dirs() -> list[Path]:
    """The user's config dirs, in search order (from ``AREAL_CONFIG_DIR``)."""
    raw = os.environ.get(CONFIG_DIR_ENV, "")
    return [Path(p) for p in raw.split(os.pathsep) if p]


def add_config_dirs(dirs: list[str]) -> None:
    """Put ``dirs`` (``--config-dir`` values) on the search path of this process and its children.

    Each dir also goes on ``sys.path`` and ``PYTHONPATH``: code that lives next to its config (a reward
    named in ``plugins``, an agent named in ``workflow.kwargs.agent``) imports in every process of the run.
    """
    import sys

    known = [str(p) for p in user_config_dirs()]
    for raw in dirs:
        p = Path(os.path.expanduser(raw)).resolve()
        if not p.is_dir():
            raise ConfigError("--config-dir", f"{raw!r} is not a directory",
                              "point --config-dir at a folder laid out like conf/ (experiment/, model/, ...)")
        if (p / "config.yaml").exists():
            raise ConfigError("--config-dir", f"{raw!r} has a config.yaml: a config dir adds options to the "
                              "groups, the primary config stays the package's",
                              "move its settings into an experiment (DIR/experiment/NAME.yaml, "
                              "'# @package _global_') and run with experiment=NAME")
        strays = sorted(f.name for f in p.glob("*.yaml"))
        if not any((p / g).is_dir() for g in GROUPS):
            hint = f" ({', '.join(strays)} lie at its top)" if strays else ""
            raise ConfigError("--config-dir", f"{raw!r} has none of the group folders {', '.join(GROUPS)}{hint}",
                              "put each file in its group's folder, e.g. DIR/experiment/my_run.yaml "
                              "(with '# @package _global_' on its first line)")
        if str(p) not in known:
            known.append(str(p))
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    os.environ[CONFIG_DIR_ENV] = os.pathsep.join(known)
    py = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(list(dict.fromkeys(known + py)))


def search_path() -> list[Path]:
    """Every config dir, user dirs first, the packaged one last."""
    return [*user_config_dirs(), CONF_DIR]


def primary_default(group: str) -> str | None:
    """The option the packaged ``config.yaml`` picks for ``group``."""
    from areal_cli.plan.fastcompose import _load_yaml

    _, data = _load_yaml(CONF_DIR / "config.yaml")  # memoised per file
    for entry in (data or {}).get("defaults", []):
        if isinstance(entry, dict) and group in entry:
            return str(entry[group])
    return None


def find_option(group: str, option: str) -> Path | None:
    """The file behind ``group=option`` on the search path, or None."""
    for d in search_path():
        f = d / group / f"{option}.yaml"
        if f.is_file():
            return f
    return None


def _scan(d: Path) -> list[str]:
    return sorted(p[:-5] for p in os.listdir(d) if p.endswith(".yaml")) if d.is_dir() else []


def group_options(conf_dir: Path | None = None) -> dict[str, list[str]]:
    """``{group: [option, ...]}`` over the search path (or over ``conf_dir`` alone)."""
    dirs = [conf_dir] if conf_dir is not None else search_path()
    out: dict[str, list[str]] = {}
    for g in GROUPS:
        seen: dict[str, Path] = {}
        for d in reversed(dirs):  # packaged first, so a clash names the user's file
            for opt in _scan(d / g):
                if opt in seen:
                    raise ConfigError("--config-dir", f"{d / g / opt}.yaml reuses the option name "
                                      f"{g}={opt} of {seen[opt] / g / opt}.yaml",
                                      "give your file a name of its own (options extend a group; they "
                                      "do not replace a packaged one)")
                seen[opt] = d
        out[g] = sorted(seen)
    return out
