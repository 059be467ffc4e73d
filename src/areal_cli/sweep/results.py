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
    """One panel per swept key: the metric against that key's values (best trial starred), ``sweep.png``."""
    fig = build_figure(m)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path = Path(m.sweep_dir) / "sweep.png"
    fig.savefig(path, dpi=FIG_DPI)
    plt.close(fig)
    return path


FIG_DPI = 110
STAR_SIZE = 220  # points^2
# Learning rates are tried on a geometric grid (1e-5, 3e-5, 1e-4...): on a linear axis the small ones
# pile up at the left edge and their tick labels run into each other.
LOG_NAME_SUFFIXES = ("lr", "learning_rate")


def log_axis(key: str, xs: list[float]) -> bool:
    """Whether a numeric knob's axis is logarithmic: all values positive and either an lr-like name or a
    spread of at least 10x."""
    if len(set(xs)) < 2 or min(xs) <= 0:
        return False
    return key.rsplit(".", 1)[-1].endswith(LOG_NAME_SUFFIXES) or max(xs) / min(xs) >= 10


def _tick_label(v: float) -> str:
    """Short labels: ``0.0001`` → ``1e-4``, ``0.00015`` → ``1.5e-4``, ``0.5`` → ``0.5``, ``32`` → ``32``."""
    if v != 0 and not 1e-2 <= abs(v) < 1e5:
        mant, exp = f"{v:.2e}".split("e")
        return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"
    return f"{v:.4g}"


def build_figure(m: Manifest):
    """The sweep plot as a matplotlib figure (None without a finished trial or a swept key)."""
    done = [t for t in m.trials if t.status == "done" and metric_value(t, m.metric) is not None]
    if not done or not m.swept_keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FixedFormatter, NullFormatter

    best = best_trial(m)
    keys = m.swept_keys
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False, dpi=FIG_DPI)
    for ax, key in zip(axes[0], keys):
        values = [t.value_of(key) for t in done]
        numeric = all(_is_float(v) for v in values)
        xs = [float(v) for v in values] if numeric else values
        ys = [metric_value(t, m.metric) for t in done]
        ax.scatter(xs, ys, color="tab:blue")
        if best is not None:
            bx = float(best.value_of(key)) if numeric else best.value_of(key)
            ax.scatter([bx], [metric_value(best, m.metric)], marker="*", s=STAR_SIZE, color="tab:orange",
                       label="best", zorder=3)
            ax.legend(loc="best")
        if numeric and log_axis(key, xs):
            ax.set_xscale("log")
        if numeric:  # ticks at the values tried, not at round numbers none of the trials used
            ticks = sorted(set(xs))
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_major_formatter(FixedFormatter([_tick_label(v) for v in ticks]))
            ax.xaxis.set_minor_formatter(NullFormatter())
        # Room for the star's marker, which autoscaling (data points only) does not count.
        ax.margins(x=0.1, y=0.15)
        ax.set_xlabel(key)
        ax.set_ylabel(m.metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep {m.name}")
    fig.tight_layout()
    _hide_overlapping_ticks(fig)
    return fig


def _hide_overlapping_ticks(fig) -> None:
    """Blank the x tick labels that would overlap the previous kept one (close values on one axis):
    every trial's value keeps its tick mark, some lose their text."""
    from matplotlib.ticker import FixedFormatter

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        fmt = ax.xaxis.get_major_formatter()
        if not isinstance(fmt, FixedFormatter):
            continue
        texts = list(fmt.seq)
        last = None
        for i, lb in enumerate(ax.xaxis.get_majorticklabels()):
            if i >= len(texts) or not lb.get_text():
                continue
            box = lb.get_window_extent(renderer).padded(2)
            if last is not None and box.overlaps(last):
                texts[i] = ""
            else:
                last = box
        ax.xaxis.set_major_formatter(FixedFormatter(texts))


def _is_float(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False
