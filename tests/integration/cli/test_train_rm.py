"""`areal train algo=rm` end to end on the embedded task (docs/rewards.md, "Reward models"): an SFT warm start of
the tiny model, then the reward model on the built-in preference pairs (the worked answer against the same
answer with a wrong result), evaluated by held-out pairwise accuracy; the final export loads with
``transformers.AutoModelForSequenceClassification`` and ranks the held-out pairs as the run's last eval did.

CI's runs phase runs a 200-step version (about 2 min); the documented 2000-step command is `pytest -m slow`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from train_runs import _env, _records

pytestmark = pytest.mark.timeout(3000)

# The documented command's knobs (docs/rewards.md) on a fresh fileroot, without the live view.
COMMON = ["algo=rm", "allocation_mode.spec=fsdp:d1", "experiment_name=rm", "trial_name=t0", "stats.live=false",
          "trainer.sft_warmup_steps=600", "algo.batch_size=32", "algo.optim.lr=1e-3"]
DOCUMENTED = [*COMMON, "trainer.total_steps=2000", "trainer.eval_every=500", "algo.optim.lr_scheduler=cosine",
              "dataset.test_size=500"]
# CI's version: the first 200 steps at a constant rate (the documented table's 600-step run is at 81.5%
# after 100 of them), so the runs phase spends ~2 minutes, not ~9.
SHORT = [*COMMON, "trainer.total_steps=200", "trainer.eval_every=100", "dataset.test_size=200"]


def _train_rm(tmp_path, overrides: list[str], steps: int, every: int) -> tuple[object, list[dict]]:
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *overrides,
                          f"cluster.fileroot={tmp_path}"], capture_output=True, text=True, env=_env(), timeout=2900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    run_dir = tmp_path / "runs" / "rm" / "t0"
    recs = _records(run_dir)
    evals = [r for r in recs if r["kind"] == "eval" and r.get("phase") == "rm"]
    assert [r["step"] for r in evals] == list(range(0, steps + 1, every))
    assert evals[0]["eval/pairwise_accuracy"] == 0.0  # the zero-initialised head ties every pair
    assert [r["step"] for r in recs if r["kind"] == "rm"] == list(range(1, steps + 1))
    assert [r["step"] for r in recs if r["kind"] == "sft"] == list(range(1, 601))  # the warm start ran first
    return run_dir, evals


def _export_ranks_like_the_last_eval(run_dir, evals: list[dict]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from areal_cli.data.preferences import load_pairs
    from areal_cli.config.io import load_config_file

    cfg = load_config_file(str(run_dir / "config.yaml"))
    final = run_dir / "checkpoints" / "final"
    tok = AutoTokenizer.from_pretrained(final)
    pairs, _ = load_pairs(cfg.dataset, tok, "test", cfg.seed)
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    with torch.no_grad():
        wins = sum(float(model(torch.tensor([p["chosen_ids"]])).logits[0, 0])
                   > float(model(torch.tensor([p["rejected_ids"]])).logits[0, 0]) for p in pairs)
    assert wins / len(pairs) == pytest.approx(evals[-1]["eval/pairwise_accuracy"], abs=0.005)


@pytest.mark.runs
def test_reward_model_learns_to_rank_the_held_out_pairs_and_exports_a_classifier(tmp_path):
    run_dir, evals = _train_rm(tmp_path, SHORT, 200, 100)
    assert evals[-1]["eval/pairwise_accuracy"] >= 0.7, [r["eval/pairwise_accuracy"] for r in evals]
    _export_ranks_like_the_last_eval(run_dir, evals)


@pytest.mark.slow
def test_reward_model_on_the_embedded_task_reaches_90_percent_pairwise(tmp_path):
    """The documented command (~9 min on two idle cores): pytest -m slow."""
    run_dir, evals = _train_rm(tmp_path, DOCUMENTED, 2000, 500)
    assert evals[-1]["eval/pairwise_accuracy"] >= 0.9, [r["eval/pairwise_accuracy"] for r in evals]
    _export_ranks_like_the_last_eval(run_dir, evals)
