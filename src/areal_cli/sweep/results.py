"""Sweep results: a rich table, ``results.csv`` and a plot of the chosen metric against the swept values."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from areal_cli.sweep.manifest import Manifest, Trial

# Columns shown when the trainer reports them (first matching key wins).
METRIC_COLUMNS = {
    "accuracy": ("accuracy_after", "eval/pass@1"),
    "reward": ("reward_last", "reward/mean"),
    "samples/s": ("samples_per_s_avg", "perf/samples_per_s"),
}


def metric_value(t: Trial, key: str) -> float | None:
    v = t.metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else None


def pick(t: Trial, candidates: tuple[str, ...]) -> float | None:
    for k in candidates:
        v = metric_value(t, k)
        if v is not None:
            return v
    return None


def best_trial(m: Manifest) -> Trial | None:
    done = [t for t in m.trials if t.status == "done" and metric_value(t, m.metric) is not None]
    if not done:
        return None
    sign = 1 if m.mode == "max" else -1
    return max(done, key=lambda t: sign * metric_value(t, m.metric))


def rows(m: Manifest) -> list[dict]:
    out = []
    for t in m.trials:
        row = {"trial": t.id, "status": t.status}
        row.update({k: t.value_of(k) for k in m.swept_keys})
        row[m.metric] = metric_value(t, m.metric)
        for col, keys in METRIC_COLUMNS.items():
            if m.metric not in keys:
                row[col] = pick(t, keys)
        row["wall_s"] = t.wall_time_s
        out.append(row)
    return out


def write_csv(m: Manifest) -> Path:
    path = Path(m.sweep_dir) / "results.csv"
    data = [{**row, "reason": t.reason} for row, t in zip(rows(m), m.trials)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(data[0].keys()) if data else ["trial"])
        w.writeheader()
        w.writerows(data)
    return path


def render_table(m: Manifest):
    from rich.table import Table

    best = best_trial(m)
    data = rows(m)
    table = Table(title=f"sweep {m.name}: {m.metric} ({m.mode})", caption=_reasons(m) or None,
                  caption_justify="left")
    for col in (data[0].keys() if data else ["trial"]):
        table.add_column(col, overflow="fold")
    for row, t in zip(data, m.trials):
        cells = ["" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in row.values()]
        style = "bold green" if best is not None and t.id == best.id else ("red" if t.status in ("failed", "invalid") else None)
        if best is not None and t.id == best.id:
            cells[0] = "★ " + cells[0]
        table.add_row(*cells, style=style)
    return table


def _reasons(m: Manifest) -> str:
    """Why each invalid or failed trial did not run to the end, one line each."""
    return "\n".join(f"{t.id}: {t.reason}" for t in m.trials if t.status in ("invalid", "failed") and t.reason)


def plot(m: Manifest) -> Path | None:
    """One panel per swept key: the metric against that key's values (best trial starred)."""
    done = [t for t in m.trials if t.status == "done" and metric_value(t, m.metric) is not None]
    if not done or not m.swept_keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_trial(m)
    keys = m.swept_keys
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = [t.value_of(key) for t in done]
        numeric = all(_is_float(v) for v in values)
        xs = [float(v) for v in values] if numeric else values
        ys = [metric_value(t, m.metric) for t in done]
        ax.scatter(xs, ys, color="tab:blue")
        if best is not None:
            bx = float(best.value_of(key)) if numeric else best.value_of(key)
            ax.scatter([bx], [metric_value(best, m.metric)], marker="*", s=220, color="tab:orange", label="best")
            ax.legend(loc="best")
        if numeric and len(set(xs)) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 100:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(m.metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep {m.name}")
    fig.tight_layout()
    path = Path(m.sweep_dir) / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _is_float(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False
