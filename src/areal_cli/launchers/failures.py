"""The one line a user reads when a process of the run fails, instead of its traceback.

Every launcher (local and the SLURM node runner through :class:`~areal_cli.launchers.local.NodeRunner`,
Ray through its own supervision) builds its failure from the failed process's log tail here:

- a user error (``ArealError``) raised in a trainer rank: the rank prints it behind
  ``errors.USER_ERROR_PREFIX``, and that line is the error, as the CLI would have printed it;
- any other exception: its last line (``RuntimeError: …``) and the process;
- an exit without a traceback: the log's last line;
- a death by signal (SIGKILL, the OOM killer): how it ended.

The log path (and a hint, for servers) goes in the error's ``details``, the lines the CLI prints under it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from areal_cli.errors import RANK_CRASH_PREFIX, USER_ERROR_PREFIX, LaunchError

# A traceback's last line: a (dotted) exception type at column 0, then ": message" or nothing.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:: .*)?$")


def _marked(tail: str, prefix: str) -> str | None:
    found = None
    for line in tail.splitlines():
        if line.startswith(prefix):
            found = line[len(prefix):].strip()
    return found or None


def user_error_in(tail: str) -> str | None:
    """The last user error (ArealError) a trainer rank printed in ``tail``, or None."""
    return _marked(tail, USER_ERROR_PREFIX)


def error_line(tail: str) -> str | None:
    """The one line a log ``tail`` ends with an error on: a user error, else a rank's crash line, else the
    last traceback's exception line (``areal status`` shows it for each process)."""
    return user_error_in(tail) or _marked(tail, RANK_CRASH_PREFIX) or exception_line(tail)


def exception_line(tail: str) -> str | None:
    """The last traceback's exception line in ``tail`` (``RuntimeError: boom``), or None.

    Found from the end: a line at column 0 shaped like ``pkg.Type: message`` right after an indented line
    (a traceback's source line or its ``^^^`` marks), so a traceback cut at its top by the tail still counts,
    and a later line of a multi-line message does not."""
    lines = tail.splitlines()
    for i in range(len(lines) - 1, 0, -1):
        line = lines[i]
        if not line or line[0].isspace() or not _EXCEPTION_LINE.match(line):
            continue
        prev = next((p for p in reversed(lines[:i]) if p.strip()), "")
        if prev[:1].isspace():
            return line.strip()
    return None


def process_failure(who: str, log: str | os.PathLike, tail: str, how: str, *, hint: str = "",
                    stopped: str = "everything was stopped") -> LaunchError:
    """The error for process ``who`` (``trainer rank 0``) that ended ``how`` (``exit code 1``), from its log's
    ``tail``: the user error it raised, else its exception's last line, else how it ended."""
    user = user_error_in(tail)
    if user is not None:
        err = LaunchError(user)
        err.details = [f"raised in {who}; log {log}; {stopped}"]
        return err
    exc = _marked(tail, RANK_CRASH_PREFIX) or exception_line(tail)
    last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
    if exc is None and last and how.startswith("exit code"):  # no traceback (argparse, a C++ abort)
        exc = last if len(last) <= 300 else last[:297] + "…"
    err = LaunchError(f"{who} failed: {exc}" if exc else f"{who} failed ({how})")
    err.details = [f"{how}; log {log}; {stopped}" if exc else f"log {log}; {stopped}"]
    if hint:
        err.details = [*err.details, f"hint: {hint}"]
    return err


class RankLogWatch:
    """What the trainer ranks append to ``<run_dir>/logs/trainer_rank*.log`` during this launch, read as it
    comes, so the node runner stops the run as soon as a rank prints its dying line (the process itself
    and torchrun can take seconds more to exit), and names the failure from this launch's lines only
    (a resumed run's logs go on from the earlier launches')."""

    KEEP = 64 * 1024  # of each log's recent text: enough for a traceback

    def __init__(self, log_dir: str | os.PathLike):
        self.dir = Path(log_dir)
        self.offsets = {p.name: p.stat().st_size for p in self._logs()}
        self.recent: dict[str, str] = {}

    def _logs(self) -> list[Path]:
        return sorted(self.dir.glob("trainer_rank*.log"))

    def poll(self) -> tuple[str, Path, str] | None:
        """``(who, log, tail)`` of a rank that printed a user error or a crash line, a user error first."""
        hits = []
        for p in self._logs():
            try:
                with open(p, "rb") as f:
                    f.seek(self.offsets.get(p.name, 0))
                    data = f.read()
                    self.offsets[p.name] = f.tell()
            except OSError:
                continue
            if data:
                text = self.recent.get(p.name, "") + data.decode("utf-8", "replace")
                self.recent[p.name] = text[-self.KEEP:]
            text = self.recent.get(p.name, "")
            if USER_ERROR_PREFIX in text or RANK_CRASH_PREFIX in text:
                m = re.search(r"trainer_rank(\d+)", p.name)
                who = f"trainer rank {m.group(1) if m else '?'}"
                tail = "\n".join(text.splitlines()[-80:])
                hits.append((USER_ERROR_PREFIX not in text, p.stat().st_mtime, who, p, tail))
        if not hits:
            return None
        _, _, who, p, tail = min(hits)
        return who, p, tail
