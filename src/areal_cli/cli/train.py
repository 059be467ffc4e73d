"""``areal train [overrides…]``: compose, validate, then launch (or ``--dry-run`` / ``--cfg job``).

The launch itself is one call, :func:`areal_cli.cli.launch.run_train` (prepare, launch, watch,
summarise); this module only composes, validates and hands over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

HELP = ("Compose and validate the config, then launch inference servers and trainers. "
        "--dry-run stops after printing the plan; --cfg job prints the composed config.")


def launch(cfg: ExperimentConfig, plan, overrides: list[str] | None = None, choice=None) -> int:
    """Hand the validated config and plan to the launcher; returns the exit code."""
    from areal_cli.cli.launch import run_train

    rv = run_train(cfg, plan, overrides=overrides, choice=choice)
    return rv if isinstance(rv, int) else 0


def print_job_config(overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from areal_cli.plan.compose import compose_dictconfig

    print(OmegaConf.to_yaml(compose_dictconfig(overrides), resolve=True), end="")


def show_dry_run(cfg: ExperimentConfig, plan, as_json: bool) -> None:
    """The plan, plus what the launcher would submit (sbatch script, SkyPilot task YAML).

    The submission text goes to stdout alone so it can be redirected into a file; the plan table and
    notes go to stderr. No cluster software is needed for any of it.
    """
    import sys

    from rich.console import Console

    from areal_cli.cli.common import print_json
    from areal_cli.cli.render import render_plan
    from areal_cli.launchers.base import get_launcher
    from areal_cli.trainer.build import layout_from_plan

    launcher = get_launcher(cfg.launcher.name)
    extra = launcher.dry_run(cfg, layout_from_plan(cfg, plan), cfg.run_dir())
    if as_json:
        print_json({**plan.to_dict(), "launcher": {"name": launcher.name, **(extra or {})}})
        return
    if extra is None:
        render_plan(plan, title="dry run: nothing launched")
        return
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    render_plan(plan, title=f"dry run: nothing launched (launcher={launcher.name})", console=err)
    if "parameters" in extra:
        err.print("submitit parameters: " + ", ".join(f"{k}={v!r}" for k, v in extra["parameters"].items()),
                  markup=False, highlight=False)
    if extra.get("note"):
        err.print(f"note: {extra['note']}", style="yellow", markup=False, highlight=False)
    text = extra.get("sbatch") or extra.get("task_yaml") or extra.get("text") or ""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def run(overrides: list[str], dry_run: bool, cfg_mode: str | None, as_json: bool) -> int:
    from areal_cli.cli.common import compose_and_validate
    from areal_cli.errors import UsageError

    if cfg_mode is not None:
        if cfg_mode != "job":
            raise UsageError(f"--cfg takes 'job' (print the composed config), got '{cfg_mode}' — fix: --cfg job")
        print_job_config(overrides)
        return 0
    if as_json and not dry_run:
        # --json is for tools, and a launch has no JSON answer to give: it runs for hours behind a live view.
        raise UsageError("--json prints the plan of a dry run; a launch does not print JSON — fix: add --dry-run "
                         "(areal train --dry-run --json ...), or ask a running run with `areal status --json`")
    from areal_cli.cli.resume import settle_run

    cfg, plan = compose_and_validate(overrides, as_json, fetch_model=not dry_run)
    # The run's name and its resume are settled here, once, before anything launches: every process of the
    # run reads the name from the config.yaml written next.
    choice = settle_run(cfg, claim=not dry_run, check=not dry_run)
    if dry_run:
        show_dry_run(cfg, plan, as_json)
        return 0
    return launch(cfg, plan, overrides, choice)


def register(app) -> None:
    import typer

    from areal_cli.cli.common import OVERRIDES_HELP
    from areal_cli.cli.main import groups_epilog

    @app.command("train", help=HELP, epilog=groups_epilog())
    def train(
        overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
        dry_run: bool = typer.Option(False, "--dry-run", help="Compose, validate and print the plan only."),
        cfg: str = typer.Option(None, "--cfg", help="'job': print the composed config and exit.",
                                show_default=False),
        as_json: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as JSON "
                                     "(refused without --dry-run)."),
    ) -> int:
        return run(list(overrides or []), dry_run, cfg, as_json)
