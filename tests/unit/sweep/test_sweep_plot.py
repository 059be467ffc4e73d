"""The sweep plot (sweep/results.py): a log axis for lr-like knobs, tick labels that do not run into each
other, and the best trial's star drawn inside its axes. Built from a synthetic manifest (the figure is a
pure function of it) and measured with the Agg renderer."""

from __future__ import annotations

import math

import pytest

from areal_cli.sweep.manifest import Manifest, Trial
from areal_cli.sweep.results import STAR_SIZE, build_figure, log_axis, plot

pytest.importorskip("matplotlib")

# The grid of the report: close learning rates whose plain labels printed as `0.00010.00015...`.
LRS = ["1e-5", "3e-5", "5e-5", "1e-4", "1.5e-4", "2e-4", "3e-4", "1e-3"]
GROUPS = ["4", "8"]


def _manifest(tmp_path, best_lr: str = "1e-3") -> Manifest:
    trials = []
    for i, lr in enumerate(LRS):
        for g in GROUPS:
            # The best trial sits at the right edge of the lr axis and at the top of the metric axis,
            # where an unpadded star is clipped.
            acc = 0.95 if (lr == best_lr and g == "8") else 0.3 + 0.05 * i + (0.01 if g == "8" else 0.0)
            trials.append(Trial(id=f"t{i}_{g}", overrides=[f"algo.optim.lr={lr}", f"rollout.group_size={g}"],
                                status="done", metrics={"accuracy_after": acc}))
    return Manifest(sweep_dir=str(tmp_path), name="lr_grid", fixed=[], swept=[],
                    swept_keys=["algo.optim.lr", "rollout.group_size"], metric="accuracy_after", trials=trials)


def test_log_axis_rule():
    assert log_axis("algo.optim.lr", [1e-4, 2e-4])              # an lr-like name, even a 2x spread
    assert log_axis("algo.critic_lr", [1e-6, 5e-6])
    assert log_axis("trainer.learning_rate", [0.1, 0.2])
    assert log_axis("algo.kl_coef", [0.001, 0.01, 0.1])         # spans >= 10x
    assert not log_axis("rollout.group_size", [4, 8])
    assert not log_axis("algo.reward_bias", [-1.0, 1.0])        # not all positive
    assert not log_axis("algo.optim.lr", [1e-4])                 # one value: nothing to spread


def test_sweep_figure_axes_ticks_and_star(tmp_path):
    import matplotlib.pyplot as plt

    fig = build_figure(_manifest(tmp_path))
    try:
        renderer = fig.canvas.get_renderer()
        lr_ax, group_ax = fig.axes[0], fig.axes[1]
        assert lr_ax.get_xscale() == "log"
        assert group_ax.get_xscale() == "linear"
        for ax in (lr_ax, group_ax):
            labels = [lb for lb in ax.get_xticklabels() if lb.get_visible() and lb.get_text()]
            assert len(labels) >= 2, [lb.get_text() for lb in ax.get_xticklabels()]
            boxes = sorted((lb.get_window_extent(renderer) for lb in labels), key=lambda b: b.x0)
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), f"{ax.get_xlabel()}: tick labels overlap at {a} / {b}"
            texts = [lb.get_text() for lb in labels]
            assert all(len(t) <= 6 for t in texts), texts  # `1.5e-4`, not `0.00015000000000000001`
        assert "1e-5" in [lb.get_text() for lb in lr_ax.get_xticklabels()]  # the grid's ends are labelled
        assert "1e-3" in [lb.get_text() for lb in lr_ax.get_xticklabels()]

        # The star: its marker's full extent (centre ± radius in pixels) lies inside each axes' box.
        radius_px = math.sqrt(STAR_SIZE) / 2 * fig.dpi / 72
        for ax in (lr_ax, group_ax):
            star = next(c for c in ax.collections if c.get_label() == "best")
            (cx, cy), = ax.transData.transform(star.get_offsets())
            bbox = ax.get_window_extent(renderer)
            assert bbox.x0 <= cx - radius_px and cx + radius_px <= bbox.x1, (ax.get_xlabel(), cx, bbox)
            assert bbox.y0 <= cy - radius_px and cy + radius_px <= bbox.y1, (ax.get_xlabel(), cy, bbox)
    finally:
        plt.close(fig)


def test_plot_writes_png(tmp_path):
    path = plot(_manifest(tmp_path))
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
