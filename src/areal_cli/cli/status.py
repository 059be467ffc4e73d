"""``areal status [RUN] [--watch] [--json]``: one run's progress, read from its run dir (any launcher)."""

from __future__ import annotations

import time
from typing import Any

from areal_cli.cli.report import clock

HELP = """Show a run's progress from any terminal: state, phase, step/total, ETA, last evaluation, samples/s,
staleness, each inference server and trainer rank, and the last error. Everything is read from the run dir
on the shared filesystem, so local, SLURM, Ray and SkyPilot runs look the same.

RUN is a run dir, EXPERIMENT/TRIAL, or EXPERIMENT (its most recently active trial); without RUN, the most
recently active run under --fileroot (default: cluster.fileroot's default, ~/.cache/areal).

\b
Examples:
  areal status                          (the latest run)
  areal status cpu_default --watch      (refresh until the run ends; Ctrl-C leaves)
  areal status /shared/areal/runs/qwen/t3 --json
"""

RUN_HELP = "A run dir, EXPERIMENT/TRIAL, or EXPERIMENT (its latest trial); default: the latest run."
FILEROOT_HELP = "The runs' cluster.fileroot (default ~/.cache/areal)."
LIVE_STATES = ("running", "queued", "starting")
STATE_STYLE = {"running": "bold green", "finished": "bold cyan", "failed": "bold red",
               "interrupted": "bold yellow",
               "queued": "bold", "starting": "bold"}


# ---------------------------------------------------------------- formatting shared with `areal runs`

def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def step_text(s: dict[str, Any]) -> str:
    if s["phase"] == "sft warmup":
        return f"{s['sft_step']}/{s['sft_warmup_steps']}"  # of the warm start (the phase says so)
    return f"{s['step']}/{s['total_steps']}" if s["total_steps"] else str(s["step"])


def eval_text(s: dict[str, Any], with_first: bool = False) -> str:
    e = s.get("last_eval")
    if not e or e.get("accuracy") is None:
        return "-"
    out = f"{e['accuracy']:.1%} @ step {e['step']} ({e['phase']})"
    f = s.get("first_eval")
    if with_first and f and f.get("accuracy") is not None and f is not e and f.get("time") != e.get("time"):
        out += f", from {f['accuracy']:.1%} ({f['phase']})"
    return out


def state_text(s: dict[str, Any]) -> str:
    from rich.markup import escape

    style = STATE_STYLE.get(s["state"], "bold")
    detail = f" [dim]({escape(s['state_detail'])})[/]" if s["state_detail"] else ""
    return f"[{style}]{s['state']}[/]{detail}"


def console(stderr: bool = False):
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 160, highlight=False)


# ---------------------------------------------------------------- the status view

def render(s: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    head = f"[bold]{escape(s['run'])}[/]  {state_text(s)}  [dim]{escape(s['run_dir'])}[/]"
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="cyan")
    grid.add_column()
    where = f"{s['phase']} · step {step_text(s)}"
    if s["eta_s"] is not None and s["state"] == "running":
        where += f" · ETA {clock(s['eta_s'])}"
    if s["phase"] == "sft warmup" and s["phase_eta_s"] is not None:
        where += f" · warm start ends in {clock(s['phase_eta_s'])}"
    grid.add_row("phase", where)
    grid.add_row("started", f"{when(s['started'])} · {clock(s['elapsed_s'])} elapsed"
                 + (f" · {s['launcher']}" if s["launcher"] else ""))
    grid.add_row("last eval", escape(eval_text(s, with_first=True)))
    if s["sft_loss"] is not None and (s["phase"] in ("sft warmup", "sft") or not s["step"]):
        grid.add_row("sft", f"loss {s['sft_loss']:.3f} at step {s['sft_step'] or s['step']}")
    rates = []
    if s["reward"] is not None:
        rates.append(f"reward {s['reward']:.3f}")
    if s["samples_per_s"] is not None:
        rates.append(f"{s['samples_per_s']:.1f} samples/s")
    if s["staleness_mean"] is not None:
        rates.append(f"staleness {s['staleness_mean']:.2f} (max {s['staleness_max'] or 0:.0f})")
    if rates:
        grid.add_row("last step", " · ".join(rates))
    if s["recover_step"] is not None:
        grid.add_row("resumable", f"from step {s['recover_step']} (recover/)")
    grid.add_row("error", f"[red]{escape(s['error'])}[/]" if s["error"] else "-")
    procs = Table(header_style="bold cyan", box=None, pad_edge=False)
    for col in ("process", "state", "where", "log"):
        procs.add_column(col)
    for p in s["servers"]:
        addr = p["address"] or "-"
        extra = f" ({p['backend']})" if p["backend"] else ""
        extra += f", {p['restarts']} restart(s)" if p["restarts"] else ""
        procs.add_row(p["name"], _proc_state(p), escape(addr + extra), escape(p["log"]))
    for p in s["trainer_ranks"]:
        procs.add_row(f"trainer rank {p['rank']}", _proc_state(p), "", escape(p["log"]))
    parts: list[Any] = [head, grid, procs]
    for p in [*s["servers"], *s["trainer_ranks"]]:
        if p["error"] and p["error"] != s["error"]:
            name = p.get("name") or f"trainer rank {p['rank']}"
            parts.append(f"[red]{escape(name)}: {escape(p['error'])}[/]")
    return Group(*parts)


def _proc_state(p: dict[str, Any]) -> str:
    style = {"up": "green", "running": "green", "done": "cyan", "failed": "red", "restarting": "yellow"}
    st = p["state"]
    return f"[{style[st]}]{st}[/]" if st in style else st


def run(run_arg: str | None, fileroot: str | None, watch: bool, as_json: bool, interval: float) -> int:
    from areal_cli.errors import UsageError
    from areal_cli.runs.rundir import resolve_run, snapshot

    if watch and as_json:
        raise UsageError("--watch and --json do not combine — fix: poll `areal status --json` instead")
    run_dir = resolve_run(run_arg, fileroot)
    if as_json:
        from areal_cli.cli.common import print_json

        print_json(snapshot(run_dir))
        return 0
    con = console()
    if not watch:
        con.print(render(snapshot(run_dir)))
        return 0
    from rich.live import Live

    s = snapshot(run_dir)
    try:
        with Live(render(s), console=con, refresh_per_second=4, transient=False) as live:
            while s["state"] in LIVE_STATES:
                time.sleep(interval)
                s = snapshot(run_dir)
                live.update(render(s))
    except KeyboardInterrupt:
        pass  # leaving the view; the run goes on
    return 0


def register(app) -> None:
    import typer

    @app.command("status", help=HELP)
    def status(
        run_arg: str = typer.Argument(None, metavar="RUN", help=RUN_HELP, show_default=False),
        fileroot: str = typer.Option(None, "--fileroot", help=FILEROOT_HELP, show_default=False),
        watch: bool = typer.Option(False, "--watch", "-w",
                                   help="Refresh until the run ends (Ctrl-C leaves)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object (keys: docs/train.md)."),
        interval: float = typer.Option(2.0, "--interval", help="Seconds between --watch refreshes."),
    ) -> int:
        return run(run_arg, fileroot, watch, as_json, interval)
