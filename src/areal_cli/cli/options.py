"""Shared typer options. ``--help`` is our own eager bool option: typer's built-in one is coerced
through pydantic on every invocation, and importing pydantic would dominate `areal validate-config`."""

from __future__ import annotations

import typer


def _show_help(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


def help_option():
    return typer.Option(False, "--help", "-h", is_eager=True, expose_value=False, callback=_show_help,
                        help="Show this message and exit.")
