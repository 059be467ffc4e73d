"""``areal validate-config [overrides…] [--json]``: compose, check every rule, print the plan."""

from __future__ import annotations

import typer  # at module level: typer resolves the `typer.Context` annotation from module globals

HELP = ("Compose the config and check every constraint (no GPU, no weights). Prints the components, "
        "their placement on nodes/devices, per-device micro-batch and memory estimates. "
        "Exit 0 valid, 1 invalid config, 2 usage error.")


def run(overrides: list[str], as_json: bool) -> int:
    from areal_cli.cli.common import compose_and_validate, print_json

    _, plan = compose_and_validate(overrides, as_json)
    if as_json:
        print_json(plan.to_dict())
    else:
        from areal_cli.cli.render import render_plan

        render_plan(plan, title="valid configuration")
    return 0


def register(app) -> None:
    from areal_cli.cli.common import OVERRIDES_HELP
    from areal_cli.cli.main import groups_epilog
    from areal_cli.cli.options import help_option

    # Overrides are taken as extra args rather than a typed list argument: typer coerces typed
    # parameters through pydantic, whose import alone would cost this command a third of its budget.
    @app.command("validate-config", help=f"{HELP}\n\nOVERRIDES: {OVERRIDES_HELP}.", epilog=groups_epilog(),
                 options_metavar="[OPTIONS] [OVERRIDES]...", add_help_option=False,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
    def validate_config(
        ctx: typer.Context,
        as_json: bool = typer.Option(False, "--json", help="Print the plan (or the error) as JSON."),
        help_: bool = help_option(),
    ) -> int:
        return run(list(ctx.args), as_json)
