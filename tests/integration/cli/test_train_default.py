"""The embedded default, end to end: `areal train` with no arguments must learn.

Slow (several minutes on 2 cores): `pytest -m slow tests/integration/cli/test_train_default.py`.
The wall time is printed, never asserted (house rule); docs/embedded_default.md records measured figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_runs import _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _train(root, *overrides: str) -> tuple[dict, Path, float]:
    """``areal train`` with ``overrides`` under ``root``: (summary, its run dir, wall seconds)."""
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={root}",
                          *overrides], capture_output=True, text=True, env=_env(), timeout=1700)
    wall = time.time() - t0
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    runs = list((root / "runs").glob("*/*/summary.json"))
    assert len(runs) == 1
    return json.loads(runs[0].read_text()), runs[0].parent, wall


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The embedded default (fsdp), run once: its own test and every engine's comparison read it."""
    return _train(tmp_path_factory.mktemp("default"))


def test_default_run_learns(default_run):
    summary, run_dir, wall = default_run
    print(f"\ndefault run: wall {wall:.0f}s, accuracy {summary['accuracy_before']:.1%} -> "
          f"{summary['accuracy_after']:.1%}")
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.40, summary
    # The RL phase itself must show: issue 23 asks for >= 25 points over the SFT warm start (measured with
    # 3 seeds: +31.5 to +40) and a smoothed train reward that visibly rises (measured: +0.2 to +0.3).
    print(f"RL: warm start {summary['accuracy_warm_start']:.1%}, gain {summary['rl_gain']:+.1%}; smoothed reward "
          f"{summary['reward_smoothed_first']:.2f} -> {summary['reward_smoothed_last']:.2f}")
    assert summary["rl_gain"] >= 0.25, summary
    assert summary["reward_smoothed_last"] - summary["reward_smoothed_first"] >= 0.10, summary
    assert (run_dir / "learning_curve.png").exists()
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()


def _gain(summary: dict) -> float:
    return summary["accuracy_after"] - summary["accuracy_before"]


@pytest.mark.parametrize("spec", ["hf:d1+archon:d1t2", "hf:d1+archon:d1p2", "hf:d1+megatron:d1t2",
                                  "hf:d1+deepspeed:d2"])
def test_archon_default_run_learns_as_much_as_fsdp(tmp_path, spec, default_run):
    """The embedded default under archon or megatron tensor or pipeline parallelism, or DeepSpeed ZeRO-3 at d2:
    held-out gain within 10 points of fsdp's with the same seed (the fsdp run is the module's default run)."""
    engine = spec.split("+")[1].split(":")[0]
    fsdp_gain, fsdp_wall = _gain(default_run[0]), default_run[2]
    summary, _, wall = _train(tmp_path / engine, f"engine={engine}", f"allocation_mode={spec}",
                              "cluster.n_gpus_per_node=3")
    gain = _gain(summary)
    print(f"\n{spec}: gain {gain:+.1%} in {wall:.0f}s; fsdp {fsdp_gain:+.1%} in {fsdp_wall:.0f}s")
    # One-sided: runs of one seed still differ by about ±10 points (async batching and reduction order
    # change the sampled tokens), and learning more than fsdp is no defect of the engine.
    assert gain >= 0.40 and gain >= fsdp_gain - 0.10, (gain, fsdp_gain)
