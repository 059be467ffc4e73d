"""`areal train algo=rm` end to end on the embedded task (docs/rewards.md, "Reward models"): an SFT warm start of
the tiny model, then the reward model on the built-in preference pairs (the worked answer against the same
answer with a wrong result), evaluated by held-out pairwise accuracy; the final export loads with
``transformers.AutoModelForSequenceClassification`` and ranks the held-out pairs as the run's last eval did.

Minutes of CPU: CI's runs phase (pytest -m runs tests/integration), not the default suite.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from train_runs import _env, _records

pytestmark = [pytest.mark.timeout(3000), pytest.mark.runs]

# The documented command's knobs (docs/rewards.md) on a fresh fileroot, without the live view.
RUN = ["algo=rm", "allocation_mode.spec=fsdp:d1", "experiment_name=rm", "trial_name=t0", "stats.live=false",
       "trainer.sft_warmup_steps=600", "trainer.total_steps=2000", "trainer.eval_every=500",
       "algo.batch_size=32", "algo.optim.lr=1e-3", "algo.optim.lr_scheduler=cosine", "dataset.test_size=500"]


def test_reward_model_on_the_embedded_task_reaches_90_percent_pairwise(tmp_path):
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *RUN,
                          f"cluster.fileroot={tmp_path}"], capture_output=True, text=True, env=_env(), timeout=2900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    run_dir = tmp_path / "runs" / "rm" / "t0"
    recs = _records(run_dir)
    evals = [r for r in recs if r["kind"] == "eval" and r.get("phase") == "rm"]
    assert [r["step"] for r in evals] == [0, 500, 1000, 1500, 2000]
    assert evals[0]["eval/pairwise_accuracy"] == 0.0  # the zero-initialised head ties every pair
    assert evals[-1]["eval/pairwise_accuracy"] >= 0.9, [r["eval/pairwise_accuracy"] for r in evals]
    assert [r["step"] for r in recs if r["kind"] == "rm"] == list(range(1, 2001))
    assert [r["step"] for r in recs if r["kind"] == "sft"] == list(range(1, 601))  # the warm start ran first

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from areal_cli.data.preferences import load_pairs
    from areal_cli.trainer.config_io import load_config_file

    cfg = load_config_file(str(run_dir / "config.yaml"))
    final = run_dir / "checkpoints" / "final"
    tok = AutoTokenizer.from_pretrained(final)
    pairs, _ = load_pairs(cfg.dataset, tok, "test", cfg.seed)
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    with torch.no_grad():
        wins = sum(float(model(torch.tensor([p["chosen_ids"]])).logits[0, 0])
                   > float(model(torch.tensor([p["rejected_ids"]])).logits[0, 0]) for p in pairs)
    assert wins / len(pairs) == pytest.approx(evals[-1]["eval/pairwise_accuracy"], abs=0.005)
