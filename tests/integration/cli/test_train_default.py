"""The embedded default, end to end: `areal train` with no arguments must learn.

Slow (several minutes on 2 cores): `pytest -m slow tests/integration/cli/test_train_default.py`.
The wall time is printed, never asserted (house rule); docs/train.md records measured figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from train_runs import _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_default_run_learns(tmp_path):
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={tmp_path}"],
                         capture_output=True, text=True, env=_env(), timeout=1700)
    wall = time.time() - t0
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    runs = list((tmp_path / "runs").glob("*/*/summary.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    print(f"\ndefault run: wall {wall:.0f}s, accuracy {summary['accuracy_before']:.1%} -> "
          f"{summary['accuracy_after']:.1%}")
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.40, summary
    # The RL phase itself must show: issue 23 asks for >= 25 points over the SFT warm start (measured with
    # 3 seeds: +31.5 to +40) and a smoothed train reward that visibly rises (measured: +0.2 to +0.3).
    print(f"RL: warm start {summary['accuracy_warm_start']:.1%}, gain {summary['rl_gain']:+.1%}; smoothed reward "
          f"{summary['reward_smoothed_first']:.2f} -> {summary['reward_smoothed_last']:.2f}")
    assert summary["rl_gain"] >= 0.25, summary
    assert summary["reward_smoothed_last"] - summary["reward_smoothed_first"] >= 0.10, summary
    assert (runs[0].parent / "learning_curve.png").exists()
    assert (runs[0].parent / "checkpoints" / "final" / "config.json").exists()


def _default_gain(tmp_path, *overrides: str) -> tuple[float, float]:
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={tmp_path}",
                          *overrides], capture_output=True, text=True, env=_env(), timeout=1700)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (summary_path,) = (tmp_path / "runs").glob("*/*/summary.json")
    s = json.loads(summary_path.read_text())
    return s["accuracy_after"] - s["accuracy_before"], time.time() - t0


@pytest.mark.parametrize("spec", ["hf:d1+archon:d1t2", "hf:d1+archon:d1p2", "hf:d1+megatron:d1t2",
                                  "hf:d1+deepspeed:d2"])
def test_archon_default_run_learns_as_much_as_fsdp(tmp_path, spec):
    """The embedded default under archon or megatron tensor or pipeline parallelism, or DeepSpeed ZeRO-3 at d2:
    held-out gain within 10 points of fsdp's with the same seed (both measured here, one after the other)."""
    engine = spec.split("+")[1].split(":")[0]
    fsdp_gain, fsdp_wall = _default_gain(tmp_path / "fsdp")
    gain, wall = _default_gain(tmp_path / engine, f"engine={engine}", f"allocation_mode={spec}",
                               "cluster.n_gpus_per_node=3")
    print(f"\n{spec}: gain {gain:+.1%} in {wall:.0f}s; fsdp {fsdp_gain:+.1%} in {fsdp_wall:.0f}s")
    # One-sided: runs of one seed still differ by about ±10 points (async batching and reduction order
    # change the sampled tokens), and learning more than fsdp is no defect of the engine.
    assert gain >= 0.40 and gain >= fsdp_gain - 0.10, (gain, fsdp_gain)
