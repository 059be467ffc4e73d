"""Reward-model forward and Bradley–Terry loss at d2 (fsdp, archon) and t2 (archon) against the one-process
reference: the same pair stats per step (loss, accuracy, margin, mean rewards over every pair), the same
per-row rewards, and the same weights after the steps (fp32, 1e-5), as the other layouts
(tests/support/engine_reference.py). A token budget of one sequence per micro-batch puts the two sides of
every pair in different micro-batches, and the reference trained that way matches too: the two-pass step
(algorithms/reward_model.py) gives the pair loss's gradient whatever the split.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_reference import close  # noqa: E402
from fsdp_worker import launch  # noqa: E402

pytestmark = pytest.mark.engines

TOL = 1e-5
BIG, SMALL = 10_000, 1
WORKER = str(Path(__file__).resolve().parents[2] / "support" / "rm_worker.py")
KEYS = ("rm/loss", "rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected", "rm/pairs")


@pytest.fixture(scope="module")
def runs(model4, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_runs")
    w1 = [{"name": "ref", "engine": {"max_tokens_per_mb": BIG}, "export": True},
          {"name": "ref_split", "engine": {"max_tokens_per_mb": SMALL}}]
    w2 = [{"name": "fsdp_d2", "parallel": {"dp": 2}, "engine": {"max_tokens_per_mb": BIG}},
          {"name": "archon_d2", "cls": "archon", "parallel": {"dp": 2}, "engine": {"max_tokens_per_mb": SMALL}},
          {"name": "archon_t2", "cls": "archon", "parallel": {"tp": 2}, "engine": {"max_tokens_per_mb": BIG},
           "export": True}]
    for world, variants in ((1, w1), (2, w2)):
        launch({"model_dir": model4, "out": str(out), "variants": variants}, world, timeout=600, script=WORKER)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


@pytest.mark.parametrize("name", ["ref_split", "fsdp_d2", "archon_d2", "archon_t2"])
def test_rm_layout_matches_the_one_process_reference(runs, name):
    ref, got = runs["ref"], runs[name]
    for s_ref, s_got in zip(ref["stats"], got["stats"], strict=True):
        for k in KEYS:
            assert abs(s_ref[k] - s_got[k]) <= TOL, (k, s_ref[k], s_got[k])
        assert abs(s_ref["rm/grad_norm"] - s_got["rm/grad_norm"]) <= 1e-4
    assert (ref["rewards"] - got["rewards"]).abs().max().item() <= TOL
    close(ref["weights"], got["weights"], names=dict)  # lm_head.* is the value head, never tied


def test_the_reference_learns_something(runs):
    """Not a vacuous match: the rewards after a step are not all equal and the loss left log 2."""
    ref = runs["ref"]
    assert ref["rewards"].std().item() > 1e-4
    assert abs(ref["stats"][-1]["rm/loss"] - 0.6931471805599453) > 1e-5


@pytest.mark.parametrize("name", ["ref", "archon_t2"])
def test_export_loads_with_transformers_and_scores_as_the_engine(runs, name):
    """``AutoModelForSequenceClassification`` loads the export, and its score of each sequence is the engine's
    reward up to the head's bias (left out of ``score``; zero-gradient under Bradley–Terry)."""
    got = runs[name]
    assert got["seq_cls"] and got["hf_class"] == "Qwen2ForSequenceClassification"
    bias = got["weights"]["lm_head.bias"].item()
    assert (got["hf_rewards"] + bias - got["final_rewards"]).abs().max().item() <= 1e-4
    assert got["final_rewards"].std().item() > 1e-4
