"""``areal runs [--fileroot DIR] [--json]``: the runs under a fileroot, most recently active first."""

from __future__ import annotations

HELP = """List the runs under a fileroot (<fileroot>/runs/EXPERIMENT/TRIAL), most recently active first:
state (running, finished, failed, interrupted; queued: a SLURM job not started yet), step/total, the last
held-out evaluation, when it started and its run dir. Read from the run dirs alone: any launcher's runs.

\b
Examples:
  areal runs
  areal runs --fileroot /shared/areal
  areal runs --json
"""


def run(fileroot: str | None, as_json: bool, limit: int) -> int:
    from areal_cli.runs.rundir import list_runs, runs_root, summary

    dirs = list_runs(fileroot)
    if limit > 0:
        dirs = dirs[:limit]
    rows = [summary(d) for d in dirs]
    if as_json:
        from areal_cli.cli.common import print_json

        print_json(rows)
        return 0
    from rich.markup import escape
    from rich.table import Table

    from areal_cli.cli.status import console, eval_text, state_text, step_text, when

    con = console()
    if not rows:
        con.print(f"no runs under {escape(str(runs_root(fileroot)))}; start one with `areal train` "
                  "(or pass --fileroot DIR, the runs' cluster.fileroot)")
        return 0
    t = Table(header_style="bold cyan", title=f"runs under {escape(str(runs_root(fileroot)))}",
              title_justify="left")
    for col in ("run", "state", "phase", "step", "last eval", "started", "run dir"):
        t.add_column(col, justify="right" if col == "step" else "left")
    for s in rows:
        t.add_row(escape(s["run"]), state_text({**s, "state_detail": ""}), s["phase"], step_text(s),
                  escape(eval_text(s)), when(s["started"]), escape(s["run_dir"]))
    con.print(t)
    return 0


def register(app) -> None:
    import typer

    from areal_cli.cli.status import FILEROOT_HELP

    @app.command("runs", help=HELP)
    def runs(
        fileroot: str = typer.Option(None, "--fileroot", help=FILEROOT_HELP, show_default=False),
        as_json: bool = typer.Option(False, "--json", help="Print a JSON list (each entry: `status --json`'s "
                                     "keys without servers, trainer_ranks, error)."),
        limit: int = typer.Option(0, "--limit", "-n", help="Show only the N most recently active runs."),
    ) -> int:
        return run(fileroot, as_json, limit)
