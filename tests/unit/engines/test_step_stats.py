"""StepStats: the step's sums read once are the sums of ``float(t)`` taken per micro-batch, bit for bit."""

from __future__ import annotations

import pytest
import torch

from areal_cli.engines.step_stats import StepStats


def test_totals_equal_per_micro_batch_floats():
    g = torch.Generator().manual_seed(0)
    acc, loss_ref, ref = StepStats(), 0.0, {}
    for i in range(13):
        w = float(torch.rand(1, generator=g)) * 7
        scaled = (torch.randn((), generator=g) * 1e3).requires_grad_()
        stats = {"a": torch.randn((), generator=g), "b": torch.randn((1,), generator=g).to(torch.bfloat16),
                 "n": torch.tensor(i), "py": 0.1 * i}
        counts = torch.tensor([i % 3, i % 4])  # [differing, replayed]: no ratio when 0 replayed
        acc.add_loss(scaled)
        acc.add(stats, w)
        acc.add_ratio("mismatch", counts, w)
        loss_ref += float(scaled.detach())
        for k, v in stats.items():
            ref[k] = ref.get(k, 0.0) + float(v) * w
        if int(counts[1]) > 0:
            ref["mismatch"] = ref.get("mismatch", 0.0) + int(counts[0]) / int(counts[1]) * w
    loss, sums = acc.totals()
    assert loss == loss_ref  # exact: same float64 values, same order
    assert sums == ref and set(sums) == {"a", "b", "n", "py", "mismatch"}


def test_ratio_absent_when_nothing_replayed_and_stats_must_be_scalars():
    acc = StepStats()
    acc.add_ratio("mismatch", torch.tensor([0, 0]), 1.0)
    acc.add_ratio("mismatch", None, 1.0)
    assert acc.totals() == (0.0, {})
    with pytest.raises(ValueError, match="one number"):
        acc.add({"v": torch.ones(3)}, 1.0)
