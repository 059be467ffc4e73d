"""`areal train model.lora.rank=8` on the embedded default learns: its held-out gain is at least half of
full fine-tuning's with the same seed (both measured here, one after the other).

The embedded default warm-starts with SFT (all weights, identical in both runs), then RL: full fine-tuning
in one run, a rank-8 adapter in the other. The gain compared is the RL phase's (held-out pass@1 after
RL minus after the SFT warm start), which is the part LoRA trains; the run's whole gain is printed too.
Slow (two default runs): `pytest -m slow tests/integration/test_train_lora.py`. Figures are printed, never
asserted on time (house rule).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from test_train import _env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _run(root, *overrides: str) -> dict:
    from areal_cli.trainer.stats import read_metrics

    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={root}",
                          *overrides], capture_output=True, text=True, env=_env(), timeout=3000)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (run,) = (root / "runs").glob("*/*")
    evals = [r for r in read_metrics(run) if r.get("kind") == "eval"]
    (after_sft,) = [r["eval/pass@1"] for r in evals if r.get("phase") == "sft"]
    return {"run": run, "base": evals[0]["eval/pass@1"], "sft": after_sft, "final": evals[-1]["eval/pass@1"],
            "wall": time.time() - t0}


def test_lora_default_run_learns_half_of_full(tmp_path):
    full = _run(tmp_path / "full")
    lora = _run(tmp_path / "lora", "model.lora.rank=8")
    for name, r in (("full", full), ("LoRA r8", lora)):
        print(f"\n{name}: held-out pass@1 base {r['base']:.1%} -> after SFT {r['sft']:.1%} -> after RL "
              f"{r['final']:.1%} (RL gain {r['final'] - r['sft']:+.1%}) in {r['wall']:.0f}s")
    assert full["sft"] == lora["sft"], "the SFT warm starts differ: the runs are not comparable"
    full_gain, lora_gain = full["final"] - full["sft"], lora["final"] - lora["sft"]
    assert full_gain > 0.05, full_gain  # the comparison means nothing if full fine-tuning learned nothing
    assert lora_gain >= 0.5 * full_gain, (lora_gain, full_gain)
    final = lora["run"] / "checkpoints" / "final"
    assert (final / "config.json").is_file() and (final / "lora_adapter" / "adapter_config.json").is_file()
