"""``areal`` entry point: a typer app whose commands live one per module in this package.

Each command module exposes ``register(app)``; ``COMMANDS`` (a :class:`~areal_cli.registry.Registry`, like every
other name → implementation map) lists them, one line each. Nothing here imports torch, Hydra or rich at import
time: ``areal --help`` stays instant. User errors (``ArealError``) become one red line on stderr
(plus caret lines for spec parse errors) and exit 1; usage errors exit 2; never a traceback
(set ``AREAL_DEBUG=1`` to see one for internal errors, which exit 3).
"""

from __future__ import annotations

import functools
import os
import sys

from areal_cli.registry import Registry

# `areal <name>` → its module's ``register(app)``, in --help order
COMMANDS: Registry = Registry("command", "<command>")
for _name in ("validate-config", "train", "check-storage", "sweep", "runs", "status", "logs", "eval", "export",
              "plan"):
    COMMANDS.declare(_name, f"areal_cli.cli.{_name.replace('-', '_')}:register")
INTERNAL_ERROR_EXIT = 3


@functools.lru_cache(maxsize=1)
def groups_epilog() -> str:
    """Plain-text list of config groups and their options (a directory scan, no Hydra)."""
    from areal_cli.plan.groups import group_options

    lines = ["\b", "Config groups (override with group=option, values with key.path=value):"]
    for group, opts in group_options().items():
        lines.append(f"  {group:<16} {', '.join(opts)}")
    lines.append("")
    lines.append("\b")
    lines.append("allocation_mode also takes a raw spec, e.g. allocation_mode=sglang:d4+megatron:d2t2p2")
    lines.append("\b")
    lines.append("--config-dir DIR (any command) adds DIR's own groups and experiments, laid out like conf/")
    return "\n".join(lines)


def build_app(only: str | None = None):
    """The typer app. ``only``: register just that command (when argv names it), which keeps
    ``areal validate-config`` from importing every other command module."""
    import typer

    app = typer.Typer(
        name="areal",
        help="Asynchronous RL for language models: compose, validate, launch.",
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        epilog=groups_epilog(),
        add_help_option=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    from areal_cli.cli.options import help_option

    @app.callback()
    def _root(help_: bool = help_option()) -> None:
        """Asynchronous RL for language models: compose, validate, launch."""

    names = COMMANDS.declared()
    if only is not None and only in names:
        names = (only,)
    for name in names:
        COMMANDS.get(name)(app)
    return app


def print_error(exc: BaseException) -> None:
    """One red line (plain when stderr is not a terminal) plus caret lines, on stderr."""
    msg = str(exc).replace("\n", " ")
    line = f"error: {msg}"
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        line = f"\x1b[31m{line}\x1b[0m"
    print(line, file=sys.stderr)
    caret = getattr(exc, "caret_lines", None)
    if callable(caret):
        for ln in caret():
            print(ln, file=sys.stderr)
    for ln in getattr(exc, "details", None) or ():  # where it happened, what to type next: after the line
        print(f"  {ln}", file=sys.stderr)


def _click_exceptions():
    """Exception types of the click that typer uses (typer ≥0.2x vendors it as ``typer._click``)."""
    from types import SimpleNamespace

    try:
        from typer._click import exceptions as cx
    except ImportError:
        from click import exceptions as cx
    try:
        from typer import exceptions as tx
    except ImportError:
        tx = cx
    return SimpleNamespace(ClickException=cx.ClickException, UsageError=cx.UsageError,
                           Exit=getattr(tx, "Exit", getattr(cx, "Exit", SystemExit)),
                           Abort=getattr(tx, "Abort", getattr(cx, "Abort", KeyboardInterrupt)))


def click_usage_error(exc, command: str | None = None):
    """click's usage error (a ``Usage: ...`` block, then ``Error: No such option: --jsn (Possible options:
    --json)``) as our one line: ``no such option: --jsn — fix: did you mean --json? see `areal
    validate-config -h` ``. ``command``: the command argv named, for errors raised outside its context."""
    import re

    from areal_cli.errors import UsageError

    msg = " ".join(exc.format_message().split())
    fix = ""
    m = re.search(r"\s*\(Possible options: ([^)]*)\)|\.?\s*Did you mean (.*?)\?", msg)
    if m:
        fix = f"did you mean {(m.group(1) or m.group(2)).replace(', ', ' or ')}? "
        msg = msg[:m.start()] + msg[m.end():]
    msg = msg.strip().rstrip(".")
    msg = msg[:1].lower() + msg[1:]
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", "") if ctx is not None else ""
    if path in ("", "areal") and command in COMMANDS.declared():
        path = f"areal {command}"
    return UsageError(f"{msg} — fix: {fix}see `{path or 'areal'} -h`")


def take_config_dirs(args: list[str]) -> tuple[list[str], list[str]]:
    """Split ``--config-dir DIR`` / ``--config-dir=DIR`` / ``-cd DIR`` (Hydra's spellings, any command,
    any position) from the rest of ``args``."""
    from areal_cli.errors import UsageError

    rest, dirs = [], []
    it = iter(args)
    for a in it:
        if a in ("--config-dir", "-cd"):
            d = next(it, None)
            if d is None or d.startswith("-"):
                raise UsageError(f"{a} needs a directory — fix: {a} DIR")
            dirs.append(d)
        elif a.startswith("--config-dir="):
            dirs.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return rest, dirs


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and, as a console script, exits with) the exit code."""
    from areal_cli.errors import ArealError

    args = list(sys.argv[1:] if argv is None else argv)
    first = None
    try:
        args, config_dirs = take_config_dirs(args)
        if config_dirs:
            from areal_cli.plan.groups import add_config_dirs

            add_config_dirs(config_dirs)
        import typer.main

        cx = _click_exceptions()

        first = next((a for a in args if not a.startswith("-")), None)
        command = typer.main.get_command(build_app(only=first))
        rv = command.main(args=args, prog_name="areal", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except ArealError as exc:
        print_error(exc)
        code = exc.exit_code
    except cx.UsageError as exc:
        print_error(click_usage_error(exc, first))
        code = 2
    except cx.ClickException as exc:
        exc.show(file=sys.stderr)
        code = exc.exit_code
    except cx.Exit as exc:
        code = exc.exit_code
    except (cx.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        code = 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("AREAL_DEBUG"):
            raise
        print_error(RuntimeError(f"internal error ({type(exc).__name__}: {exc}); rerun with "
                                 "AREAL_DEBUG=1 for a traceback and report it"))
        code = INTERNAL_ERROR_EXIT
    if argv is None:
        sys.stdout.flush()
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    main()
