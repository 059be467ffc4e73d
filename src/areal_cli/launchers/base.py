"""What every launcher (local, SLURM, SkyPilot, Ray) agrees on.

A launcher turns a validated plan into running processes. The plan is first flattened into a
:class:`JobLayout` (plain, JSON-serialisable): which inference servers run on which node with which
devices, and how many trainer ranks each node hosts. Launchers differ only in *how* they get a
process onto a node; what runs on one node is :func:`areal_cli.launchers.local.run_node`, except under
Ray, where each process is its own actor (:mod:`areal_cli.launchers.ray`).

The run dir's shared files (the layout, the server address book, the run's status) are in
:mod:`areal_cli.job`, below every folder that reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_cli.job.layout import JobLayout
from areal_cli.registry import Registry

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


@runtime_checkable
class Launcher(Protocol):
    """Starts one experiment's processes and supervises them until they end.

    ``launch`` returns the process exit code to propagate (0 on success) and raises
    :class:`areal_cli.errors.LaunchError` naming the failed process and its log tail.
    """

    name: str

    def preflight(self, cfg: ExperimentConfig, layout: JobLayout) -> None:
        """Raise :class:`areal_cli.errors.LaunchError` if this machine cannot launch the plan at all
        (missing cluster tools, too many nodes). Runs before the model and run dir are prepared."""

    def dry_run(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any] | None:
        """What a launch would submit (a script, a task file), for ``areal train --dry-run``; None
        when it submits nothing beyond the plan. Needs no cluster software."""

    def launch(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str, *, model_path: str | None = None,
               model_revision: str | None = None, on_tick: Callable[[], None] | None = None) -> int:
        """Every launcher takes the same arguments: ``model_path`` the model dir this machine resolved (a hub
        model fetched here), ``model_revision`` the pinned hub revision for launchers whose nodes fetch it
        themselves, ``on_tick`` called while the run is supervised from here (the live view). A launcher
        ignores what it has no use for."""
        ...


@dataclass(frozen=True)
class LauncherEntry:
    """What a launcher declares in its registry: the fix when its module cannot be imported."""

    fix: str = "reinstall areal-cli"


# launcher.name → ("module:Class", what to do when its module cannot be imported); the registry below is
# declared from it (a plugin declares its own launcher there).
LAUNCHERS: dict[str, tuple[str, str]] = {
    "local": ("areal_cli.launchers.local:LocalLauncher", "reinstall areal-cli"),
    "slurm": ("areal_cli.launchers.slurm:SlurmLauncher", "install submitit or use launcher=local"),
    "skypilot": ("areal_cli.launchers.skypilot:SkyPilotLauncher",
                 "pip install 'areal-cli[skypilot]' or use launcher=local"),
    "ray": ("areal_cli.launchers.ray:RayLauncher", "reinstall areal-cli"),
}
LAUNCHER_REGISTRY: Registry = Registry("launcher", "launcher.name", LauncherEntry)
for _name, (_target, _fix) in LAUNCHERS.items():
    LAUNCHER_REGISTRY.declare(_name, _target, fix=_fix)


def get_launcher(name: str) -> Launcher:
    """The launcher registered under ``launcher.name``."""
    from areal_cli.errors import ConfigError

    entry = LAUNCHER_REGISTRY.entry(name)
    try:
        return entry.load()()
    except ImportError as e:
        raise ConfigError("launcher.name", f"the {name} launcher cannot be imported ({e})", entry.spec.fix) from e
