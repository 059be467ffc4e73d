"""``areal train [overrides…]``: compose, validate, then launch (or ``--dry-run`` / ``--cfg job``).

The launch itself is one call, :func:`areal_cli.trainer.launch.run_train`, owned by the
training-loop layer; this module only composes, validates and hands over.
"""

from __future__ import annotations

HELP = ("Compose and validate the config, then launch inference servers and trainers. "
        "--dry-run stops after printing the plan; --cfg job prints the composed config.")


def launch(cfg, plan) -> int:
    """Hand the validated config and plan to the launcher; returns the exit code."""
    from areal_cli.errors import LaunchError

    try:
        from areal_cli.trainer.launch import run_train
    except ModuleNotFoundError as exc:
        if exc.name in ("areal_cli.trainer.launch", "areal_cli.trainer"):
            raise LaunchError("training launch is not available: areal_cli.trainer.launch is not "
                              "installed in this build — use `areal train --dry-run` to check the plan") from None
        raise
    rv = run_train(cfg, plan)
    return rv if isinstance(rv, int) else 0


def print_job_config(overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from areal_cli.config.compose import compose_dictconfig

    print(OmegaConf.to_yaml(compose_dictconfig(overrides), resolve=True), end="")


def run(overrides: list[str], dry_run: bool, cfg_mode: str | None, as_json: bool) -> int:
    from areal_cli.cli.common import compose_and_validate, error_json, print_json
    from areal_cli.errors import ArealError, UsageError

    if cfg_mode is not None:
        if cfg_mode != "job":
            raise UsageError(f"--cfg takes 'job' (print the composed config), got '{cfg_mode}'")
        print_job_config(overrides)
        return 0
    try:
        cfg, plan = compose_and_validate(overrides)
    except ArealError as exc:
        if as_json:
            print_json(error_json(exc))
        raise
    if dry_run:
        if cfg.launcher.name == "skypilot":  # the SkyPilot task YAML, validated by sky.Task.from_yaml
            from areal_cli.launchers.skypilot import dry_run as sky_dry_run

            print(sky_dry_run(cfg, plan), end="")
            return 0
        if as_json:
            print_json(plan.to_dict())
        else:
            from areal_cli.cli.render import render_plan

            render_plan(plan, title="dry run: nothing launched")
        return 0
    return launch(cfg, plan)


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
        as_json: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as JSON."),
    ) -> int:
        return run(list(overrides or []), dry_run, cfg, as_json)
