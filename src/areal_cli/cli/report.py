"""CLI-side observability: the rich live view (tailing metrics.jsonl), the final summary table and
the learning-curve PNG. Import-light: no torch; matplotlib only inside :func:`plot_learning_curve`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from areal_cli.trainer.stats import METRICS_FILE, read_metrics


class MetricsTail:
    """Incrementally reads new complete lines of a growing ``metrics.jsonl``.

    ``since``: records stamped earlier are skipped. A resumed run's file starts with the earlier launches'
    records, which the console must not show again as if new; the trainer also rewrites the file once
    (cut back to the recovered step), which is noticed (another inode, or a shorter file) and read afresh.
    """

    def __init__(self, path: str | os.PathLike, since: float | None = None):
        self.path = Path(path)
        self.since = since
        self.offset = 0
        self.buf = ""
        self.inode: int | None = None

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path) as f:
                st = os.fstat(f.fileno())
                if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
                    self.offset, self.buf = 0, ""
                self.inode = st.st_ino
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        if not chunk:
            return []
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if self.since is not None and float(rec.get("time", self.since)) < self.since:
                continue
            out.append(rec)
        return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def clock(seconds: float | None) -> str:
    """``m:ss`` or ``h:mm:ss`` (``-`` when unknown): ETAs and elapsed times, here and in ``areal status``."""
    if seconds is None or seconds < 0:
        return "-"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _rate_eta(points: list[tuple[float, int]], total: int | None) -> float | None:
    """Seconds left at the recent step rate: the last 10 ``(time, step)`` points, ``total`` steps in all."""
    if total is None or len(points) < 2:
        return None
    (t0, s0), (t1, s1) = points[max(0, len(points) - 10)], points[-1]
    if s1 <= s0:
        return None
    return (t1 - t0) / (s1 - s0) * max(0, total - s1)


class LiveView:
    """A rich Live panel. During SFT (an RL run's warm start, or all of ``algo=sft``): SFT step/total, loss,
    train tok/s, held-out accuracy and the ETA at the SFT step rate. During RL: step, reward, accuracy,
    staleness, gen/train tok/s, weight-sync time, ETA."""

    def __init__(self, run_dir: str, total_steps: int, *, title: str = "areal train", enabled: bool = True,
                 since: float | None = None, sft_steps: int | None = None, sft_only: bool = False):
        self.tail = MetricsTail(Path(run_dir) / METRICS_FILE, since=since)
        self.total_steps = total_steps
        # ``algo=sft`` trains only SFT steps (total_steps of them); an RL run's warm start has its own count.
        self.sft_only = sft_only
        self.sft_total = total_steps if sft_only else sft_steps
        self.title = title
        self.enabled = enabled
        self.last: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.first_eval: dict[str, Any] = {}
        self.sft: dict[str, Any] = {}
        self.step_times: list[tuple[float, int]] = []
        self.sft_times: list[tuple[float, int]] = []
        self.started = time.time()
        self._live = None

    def __enter__(self) -> "LiveView":
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            console = Console(stderr=True)
            self._live = Live(self.render(), console=console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self.update()
            self._live.__exit__(*exc)
            self._live = None

    def ingest(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            kind = r.get("kind")
            if kind == "train":
                self.last = r
                self.step_times.append((r.get("time", time.time()), int(r.get("step", 0))))
            elif kind == "eval":
                if not self.first_eval:
                    self.first_eval = r
                self.last_eval = r
            elif kind == "sft":
                self.sft = r
                self.sft_times.append((r.get("time", time.time()), int(r.get("step", 0))))
                if isinstance(r.get("total"), int):
                    self.sft_total = r["total"]

    def eta_s(self) -> float | None:
        return _rate_eta(self.step_times, self.total_steps)

    def sft_eta_s(self) -> float | None:
        return _rate_eta(self.sft_times, self.sft_total)

    def in_sft(self) -> bool:
        """SFT records and no RL step yet: the table shows the SFT columns."""
        return bool(self.sft) and not self.last

    def update(self) -> None:
        self.ingest(self.tail.read_new())
        if self._live is not None:
            self._live.update(self.render())

    def _accuracy(self) -> str:
        e = self.last_eval
        acc = e.get("eval/pass@1")
        acc_s = "-" if acc is None else f"{acc:.1%}"
        if self.first_eval and e is not self.first_eval and acc is not None:
            acc_s += f" (from {self.first_eval.get('eval/pass@1', 0):.1%})"
        return acc_s

    def render(self) -> Any:
        from rich.table import Table

        t = Table(title=f"{self.title} — {clock(time.time() - self.started)} elapsed", show_header=True,
                  header_style="bold cyan", expand=False)
        if self.in_sft():
            r = self.sft
            phase = "SFT" if self.sft_only else "SFT warm start"
            cols = ["phase", "step", "loss", "accuracy", "train tok/s", "ETA" if self.sft_only else "SFT ETA"]
            for c in cols:
                t.add_column(c, justify="right")
            step = r.get("step", 0)
            t.add_row(phase, f"{step}/{self.sft_total}" if self.sft_total else str(step), _fmt(r.get("sft/loss")),
                      self._accuracy(), _fmt(r.get("perf/train_tokens_per_s"), ".0f"), clock(self.sft_eta_s()))
            return t
        cols = ["step", "reward", "accuracy", "staleness", "gen tok/s", "train tok/s", "weight sync s",
                "ETA"]
        for c in cols:
            t.add_column(c, justify="right")
        r = self.last
        step = f"{r.get('step', 0)}/{self.total_steps}" if r else "starting"
        t.add_row(step, _fmt(r.get("reward/mean")), self._accuracy(),
                  _fmt(r.get("staleness/mean"), ".2f"), _fmt(r.get("perf/gen_tokens_per_s"), ".0f"),
                  _fmt(r.get("perf/train_tokens_per_s"), ".0f"), _fmt(r.get("perf/weight_sync_s"), ".3f"),
                  clock(self.eta_s()))
        return t


def summarize(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Headline numbers of a run from its metrics.jsonl."""
    recs = read_metrics(run_dir)
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    sft = [r for r in recs if r.get("kind") == "sft"]
    out: dict[str, Any] = {"steps": train[-1]["step"] if train else 0, "sft_steps": sft[-1]["step"] if sft else 0}
    rm = [r for r in recs if r.get("kind") == "rm"]
    if rm or any(r.get("phase") == "rm" for r in evals):  # algo=rm: its eval is the held-out pairwise accuracy
        out["rm_steps"] = rm[-1]["step"] if rm else 0
        evals = [r for r in evals if r.get("phase") == "rm"]
        if evals:
            out["pairwise_accuracy_before"] = evals[0].get("eval/pairwise_accuracy")
            out["pairwise_accuracy_after"] = evals[-1].get("eval/pairwise_accuracy")
        evals = []
    if evals:
        out["accuracy_before"] = evals[0].get("eval/pass@1")
        out["accuracy_after"] = evals[-1].get("eval/pass@1")
        # An RL run's warm-start evaluation is its "sft" phase; ``algo=sft`` (no RL step) has no warm start.
        warm = [r for r in evals if r.get("phase") == "sft"] if train else []
        if warm and warm[-1].get("eval/pass@1") is not None and out["accuracy_after"] is not None:
            out["accuracy_warm_start"] = warm[-1]["eval/pass@1"]
            out["rl_gain"] = out["accuracy_after"] - out["accuracy_warm_start"]
        for k in evals[-1]:
            if k.startswith("eval/pass@") and k != "eval/pass@1":
                out[k.split("/", 1)[1] + "_after"] = evals[-1][k]
    if train:
        out["reward_first"] = train[0].get("reward/mean")
        out["reward_last"] = train[-1].get("reward/mean")
        rewards = [r["reward/mean"] for r in train if isinstance(r.get("reward/mean"), (int, float))]
        if rewards:
            w = smoothing_window(len(rewards))
            out["reward_smoothed_first"] = sum(rewards[:w]) / w
            out["reward_smoothed_last"] = sum(rewards[-w:]) / w
        for key in ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s",
                    "staleness/mean", "perf/samples_per_s"):
            vals = [r[key] for r in train if isinstance(r.get(key), (int, float))]
            if vals:
                out[key.replace("perf/", "").replace("/", "_") + "_avg"] = sum(vals) / len(vals)
    starts = [r for r in recs if r.get("kind") == "event" and r.get("event") == "start"]
    ends = [r for r in recs if r.get("kind") == "event" and r.get("event") == "end"]
    if starts and ends:
        out["trainer_wall_s"] = ends[-1]["time"] - starts[0]["time"]
    return out


# Summary keys in percentage points (a difference of two accuracies); every other accuracy is a percent.
GAIN_KEYS = ("rl_gain",)


def format_summary_value(key: str, v: Any) -> str:
    """One unit per figure: accuracies as ``90.5%``, accuracy gains as ``+12.3 pts``, counts as integers."""
    number = isinstance(v, (int, float)) and not isinstance(v, bool)  # JSON may hold an accuracy of 1 as int
    if number and key in GAIN_KEYS:
        return f"{v * 100:+.1f} pts"
    if number and key.startswith(("accuracy", "pass@", "pairwise_accuracy")):
        return f"{v:.1%}"
    if isinstance(v, int):
        return str(v)
    return _fmt(v)


def summary_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="run summary", header_style="bold cyan")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        t.add_row(k, format_summary_value(k, v))
    return t


def smoothing_window(n: int) -> int:
    """Steps per point of the smoothed reward: a tenth of the run (a single step's reward is the mean of
    batch_size x group_size samples of a coin with p near 0.5, so it jumps by +-0.1 from step to step)."""
    return max(1, min(n, round(n / 10)))


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_learning_curve(run_dir: str | os.PathLike, out_name: str = "learning_curve.png") -> str | None:
    """Reward per step and held-out accuracy per eval, one PNG in the run dir. None if no data."""
    recs = read_metrics(run_dir)
    train = [r for r in recs if r.get("kind") == "train" and r.get("reward/mean") is not None]
    evals = [r for r in recs if r.get("kind") == "eval" and r.get("eval/pass@1") is not None]
    sft = [r for r in recs if r.get("kind") == "sft" and r.get("sft/loss") is not None]
    if not train and not evals and not sft:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 2 if sft else 1
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4), squeeze=False)
    ax = axes[0][0]
    if not train and not evals:
        ax.set_axis_off()
    if train:
        steps, rewards = [r["step"] for r in train], [r["reward/mean"] for r in train]
        w = smoothing_window(len(rewards))
        ax.plot(steps, rewards, label="train reward", color="C0", alpha=0.3 if w > 1 else 1.0, linewidth=1)
        if w > 1:
            ax.plot(steps, trailing_mean(rewards, w), label=f"train reward, mean of last {w} steps", color="C0",
                    linewidth=2.5)
    # The base model's evaluation (before an SFT warm start) shares step 0 with the warm start's: the RL
    # curve starts from the weights RL starts from.
    rl_evals = [r for r in evals if r.get("phase") != "base"] or evals
    if rl_evals:
        ax.plot([r["step"] for r in rl_evals], [r["eval/pass@1"] for r in rl_evals], "o-", label="held-out pass@1",
                color="C1")
    sft_run = not train and bool(evals) and all(r.get("phase") == "sft" for r in evals)  # algo=sft
    ax.set_xlabel("SFT step" if sft_run else "RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("held-out accuracy (SFT)" if sft_run else "RL learning curve")
    ax.grid(alpha=0.3)
    if train or rl_evals:
        ax.legend(loc="lower right")
    if sft:
        ax2 = axes[0][1]
        ax2.plot([r["step"] for r in sft], [r["sft/loss"] for r in sft], color="C2")
        ax2.set_xlabel("SFT step")
        ax2.set_ylabel("loss")
        ax2.set_title("SFT warm start")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / out_name
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)
