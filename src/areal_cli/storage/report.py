"""Results of a storage check: one row per (path, node, check), rendered as a table or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class CheckResult:
    """One check on one path (and node). ``figure`` is the measured value, ``fix`` what to do."""

    check: str
    status: str  # pass | warn | fail
    figure: str = ""
    fix: str = ""
    path: str = ""
    node: str = ""
    value: float | None = None  # the raw number behind ``figure`` (bytes, seconds, B/s)

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass
class StorageReport:
    results: list[CheckResult] = field(default_factory=list)

    def add(self, r: CheckResult) -> CheckResult:
        self.results.append(r)
        return r

    def extend(self, rs: list[CheckResult]) -> None:
        self.results.extend(rs)

    @property
    def ok(self) -> bool:
        return not any(r.failed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.failed]

    @property
    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == WARN]

    def get(self, check: str, path: str | None = None) -> list[CheckResult]:
        return [r for r in self.results if r.check == check and (path is None or r.path == path)]

    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "results": [asdict(r) for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def summary(self) -> str:
        """One line per failure, for a launch refusal message."""
        lines = []
        for r in self.failures:
            where = f"{r.path}" + (f" on {r.node}" if r.node else "")
            lines.append(f"  {r.check} [{where}]: {r.figure}" + (f" — fix: {r.fix}" if r.fix else ""))
        return "\n".join(lines)

    def render(self, console: Any = None) -> None:
        """A rich table: path, check, result, figure, fix."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title="areal check-storage", show_lines=False)
        for col in ("path", "check", "result", "figure", "fix"):
            table.add_column(col, overflow="fold")
        colour = {PASS: "green", WARN: "yellow", FAIL: "red"}
        for r in self.results:
            where = r.path + (f" @{r.node}" if r.node else "")
            table.add_row(where, r.check, f"[{colour.get(r.status, 'white')}]{r.status}[/]", r.figure, r.fix)
        console.print(table)
        n_fail, n_warn = len(self.failures), len(self.warnings)
        if n_fail:
            console.print(f"[red]{n_fail} check(s) failed[/], {n_warn} warning(s)")
        else:
            console.print(f"[green]all checks passed[/], {n_warn} warning(s)")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover
