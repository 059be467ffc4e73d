"""`areal train model.lora.rank=8` on the embedded default learns: its RL held-out gain is at least half of
full fine-tuning's with the same seed (both measured here, one after the other).

The embedded default warm-starts with SFT (all weights), then runs RL. The full run does both; the LoRA
run starts RL from the full run's SFT export (``model.path=<run>/sft_warmup/hf``,
``trainer.sft_warmup_steps=0``), so both RL phases start from the same weights (separate SFT warm starts
land a few points apart). The gain compared is the RL phase's: held-out pass@1 after RL minus before it.
Slow: `pytest -m slow tests/integration/cli/test_train_lora.py`. Figures are printed, never asserted on time.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from train_runs import _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _run(root, *overrides: str) -> dict:
    from areal_cli.trainer.stats import read_metrics

    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={root}",
                          *overrides], capture_output=True, text=True, env=_env(), timeout=3000)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (run,) = (root / "runs").glob("*/*")
    evals = [r for r in read_metrics(run) if r.get("kind") == "eval" and r.get("phase") != "base"]
    return {"run": run, "before": evals[0]["eval/pass@1"], "after": evals[-1]["eval/pass@1"],
            "wall": time.time() - t0}


def test_lora_default_run_learns_half_of_full(tmp_path):
    full = _run(tmp_path / "full")
    sft = full["run"] / "sft_warmup" / "hf"
    lora = _run(tmp_path / "lora", "model.lora.rank=8", f"model.path={sft}", "trainer.sft_warmup_steps=0")
    for name, r in (("full", full), ("LoRA r8", lora)):
        print(f"\n{name}: held-out pass@1 {r['before']:.1%} -> {r['after']:.1%} "
              f"(RL gain {r['after'] - r['before']:+.1%}) in {r['wall']:.0f}s")
    assert lora["before"] == full["before"], "the RL phases did not start from the same weights"
    full_gain, lora_gain = full["after"] - full["before"], lora["after"] - lora["before"]
    assert full_gain > 0.05, full_gain  # the comparison means nothing if full fine-tuning learned nothing
    assert lora_gain >= 0.5 * full_gain, (lora_gain, full_gain)
    final = lora["run"] / "checkpoints" / "final"
    assert (final / "config.json").is_file() and (final / "lora_adapter" / "adapter_config.json").is_file()
