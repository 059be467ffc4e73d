"""``areal validate-config [overrides…] [--json]``: compose, check every rule, print the plan."""

from __future__ import annotations

HELP = ("Compose the config and check every constraint (no GPU, no weights). Prints the components, "
        "their placement on nodes/devices, per-device micro-batch and memory estimates. "
        "Exit 0 valid, 1 invalid config, 2 usage error.")


def run(overrides: list[str], as_json: bool) -> int:
    from areal_cli.cli.common import compose_and_validate, error_json, print_json
    from areal_cli.errors import ArealError

    try:
        _, plan = compose_and_validate(overrides)
    except ArealError as exc:
        if as_json:
            print_json(error_json(exc))
        raise
    if as_json:
        print_json(plan.to_dict())
    else:
        from areal_cli.cli.render import render_plan

        render_plan(plan, title="valid configuration")
    return 0


def register(app) -> None:
    import typer

    from areal_cli.cli.common import OVERRIDES_HELP
    from areal_cli.cli.main import groups_epilog

    @app.command("validate-config", help=HELP, epilog=groups_epilog(), no_args_is_help=False)
    def validate_config(
        overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
        as_json: bool = typer.Option(False, "--json", help="Print the plan (or the error) as JSON."),
    ) -> int:
        return run(list(overrides or []), as_json)
