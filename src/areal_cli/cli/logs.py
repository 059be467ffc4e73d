"""``areal logs [RUN] [--rank N | --server N] [-f]``: a trainer rank's or an inference server's log."""

from __future__ import annotations

import sys
import time
from pathlib import Path

HELP = """Print the log of trainer rank N (default 0) or of inference server N of a run; -f follows it (like
tail -f) until the run ends or Ctrl-C. Logs live in <run dir>/logs on the shared filesystem, so any
launcher's runs work.

\b
Examples:
  areal logs                           (rank 0 of the latest run)
  areal logs cpu_default --server 0 -f
  areal logs exp/trial --rank 3 -n 50
"""

CHUNK = 1 << 16


def _copy(f, out) -> int:
    n = 0
    while True:
        data = f.read(CHUNK)
        if not data:
            return n
        out.write(data)
        n += len(data)


def _start_offset(path: Path, lines: int) -> int:
    """Where the last ``lines`` lines of ``path`` begin (0: the whole file)."""
    if lines <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(0, 2)
        end = pos = f.tell()
        found = 0
        while pos > 0:
            step = min(CHUNK, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            if pos + step == end and block.endswith(b"\n"):
                block = block[:-1]  # the file's final newline ends the last line, it starts none
            before, found = found, found + block.count(b"\n")
            if found >= lines:
                idx = len(block)
                for _ in range(lines - before):  # back to the newline that ends the line before the first
                    idx = block.rfind(b"\n", 0, idx)
                return pos + idx + 1
        return 0


def follow(path: Path, run_dir: Path, offset: int, poll_s: float = 0.5) -> None:
    """Write ``path`` from ``offset`` on, then what is appended, until the run is no longer live."""
    from areal_cli.cli.status import LIVE_STATES
    from areal_cli.runs.rundir import run_state

    out = sys.stdout.buffer
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            wrote = _copy(f, out)
            if wrote:
                out.flush()
                continue
            if run_state(run_dir)[0] not in LIVE_STATES:
                _copy(f, out)  # what the process wrote before it stopped
                out.flush()
                return
            time.sleep(poll_s)


def _wait_for_log(run_dir: Path, rank: int | None, server: int | None, poll_s: float = 0.5) -> Path:
    """-f on a run still starting: its process has not opened its log yet. Wait while the run is live."""
    from areal_cli.cli.status import LIVE_STATES
    from areal_cli.runs.rundir import RunNotFound, log_for, run_state, server_indices, trainer_ranks

    if server is not None:
        expected = server in server_indices(run_dir)
    else:
        expected = (rank or 0) in trainer_ranks(run_dir)
    while True:
        try:
            return log_for(run_dir, rank, server)
        except RunNotFound:
            if not expected or run_state(run_dir)[0] not in LIVE_STATES:
                raise
        time.sleep(poll_s)


def run(run_arg: str | None, fileroot: str | None, rank: int | None, server: int | None, follow_: bool,
        lines: int) -> int:
    from areal_cli.errors import UsageError
    from areal_cli.runs.rundir import log_for, resolve_run

    if rank is not None and server is not None:
        raise UsageError("--rank and --server name different logs — fix: pass one of them")
    run_dir = resolve_run(run_arg, fileroot)
    path = _wait_for_log(run_dir, rank, server) if follow_ else log_for(run_dir, rank, server)
    offset = _start_offset(path, lines)
    try:
        if follow_:
            follow(path, run_dir, offset)
        else:
            with open(path, "rb") as f:
                f.seek(offset)
                _copy(f, sys.stdout.buffer)
            sys.stdout.buffer.flush()
    except KeyboardInterrupt:
        pass  # stop following; the run goes on
    except BrokenPipeError:  # `areal logs | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def register(app) -> None:
    import typer

    from areal_cli.cli.status import FILEROOT_HELP, RUN_HELP

    @app.command("logs", help=HELP)
    def logs(
        run_arg: str = typer.Argument(None, metavar="RUN", help=RUN_HELP, show_default=False),
        rank: int = typer.Option(None, "--rank", help="Trainer rank N's log (default: rank 0).",
                                 show_default=False),
        server: int = typer.Option(None, "--server", help="Inference server N's log.", show_default=False),
        follow_: bool = typer.Option(False, "--follow", "-f", help="Keep printing what is appended until the "
                                     "run ends (Ctrl-C leaves)."),
        lines: int = typer.Option(0, "--lines", "-n", help="Start with the last N lines (default: all)."),
        fileroot: str = typer.Option(None, "--fileroot", help=FILEROOT_HELP, show_default=False),
    ) -> int:
        return run(run_arg, fileroot, rank, server, follow_, lines)
