"""Archon's parallelism library under gloo, ranks as real processes, against the one-process HF model.

Two launches feed every test (process start-up dominates on CPU): 2 ranks (t2 for Qwen2/Qwen3/Llama,
p2 under 1F1B, Interleaved1F1B and GPipe, tied embeddings, activation checkpointing, bf16 mixed
precision, vocab-parallel logprobs, typed errors) and 4 ranks (d2t2, d2p2, t2p2 and p4 with
tied embeddings). Each layout trains three steps (sequence lengths 24, 16, 16) with gradient clipping
and AdamW on the same global batches as :func:`archon_worker.reference`; see ``archon_worker.py``
for the exact setup.
"""

from __future__ import annotations

import archon_worker as W  # noqa: E402
import pytest
import torch
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

# multi-process engine layouts against their references: CI's `engines` phase (pytest -m engines tests/integration)
pytestmark = pytest.mark.engines

TOL = 1e-5
WORKER = str(SUPPORT / "archon_worker.py")

W2 = [
    {"name": "t2", "tp": 2},
    {"name": "t2_qwen3_ac", "tp": 2, "family": "qwen3", "ac": True},
    {"name": "t2_llama", "tp": 2, "family": "llama"},
    {"name": "t2_tied", "tp": 2, "tied": True},
    {"name": "p2_1f1b", "pp": 2, "schedule": "1F1B"},
    {"name": "p2_1f1b_ac", "pp": 2, "schedule": "1F1B", "ac": True},
    {"name": "p2_interleaved", "pp": 2, "schedule": "Interleaved1F1B", "virtual": 2},
    {"name": "p2_interleaved_uneven", "pp": 2, "schedule": "Interleaved1F1B", "virtual": 2,
     "layers_per_stage": [1, 2, 0, 1]},
    {"name": "p2_gpipe", "pp": 2, "schedule": "GPipe"},
    {"name": "p2_1f1b_tied", "pp": 2, "schedule": "1F1B", "tied": True},
    {"name": "p2_interleaved_tied_llama", "pp": 2, "schedule": "Interleaved1F1B", "virtual": 2, "tied": True,
     "family": "llama"},
    {"name": "d2_mp", "dp": 2, "mp": True},
    {"name": "p2_mp", "pp": 2, "schedule": "1F1B", "mp": True},
    {"name": "vocab", "kind": "vocab"},
    {"name": "errors", "kind": "errors"},
]
W4 = [
    {"name": "d2t2", "dp": 2, "tp": 2, "family": "qwen3"},
    {"name": "d2p2", "dp": 2, "pp": 2, "schedule": "1F1B"},
    {"name": "t2p2_tied", "tp": 2, "pp": 2, "schedule": "1F1B", "tied": True},
    # Four stages: the tied embedding's gradient is summed over a first/last pair group, not all of pp.
    {"name": "p4_tied_gpipe", "pp": 4, "schedule": "GPipe", "tied": True},
]
LAYOUTS = [v["name"] for v in W2 + W4 if "kind" not in v and not v.get("mp")]
MIXED = [v["name"] for v in W2 + W4 if v.get("mp")]
SPECS = {v["name"]: v for v in W2 + W4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("archon_runs")
    launch({"out": str(out), "variants": W2}, 2, script=WORKER, timeout=900)
    launch({"out": str(out), "variants": W4}, 4, script=WORKER, timeout=900)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


@pytest.fixture(scope="module")
def refs():
    torch.set_num_threads(1)
    cache: dict = {}

    def get(name: str) -> dict:
        v = SPECS[name]
        key = (v.get("family", "qwen2"), v.get("tied", False))
        if key not in cache:
            cache[key] = W.reference(*key)
        return cache[key]

    return get


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item()


def _close_dicts(got: dict, ref: dict, what: str) -> None:
    assert set(got) == set(ref), f"{what}: names differ: {sorted(set(got) ^ set(ref))}"
    for k in ref:
        d = _max_diff(got[k], ref[k])
        assert d <= TOL, f"{what} {k}: max diff {d:.3g} > {TOL}"


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process_reference(runs, refs, name):
    """Same loss, gradients (HF names), clipping norm, updated weights and logprobs/entropy at T=0.7."""
    run, ref = runs[name], refs(name)
    for got, want in zip(run["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= TOL, (got, want)
    for got, want in zip(run["grad_norms"], ref["grad_norms"], strict=True):
        assert abs(got - want) <= TOL * max(1.0, want), (got, want)
    grads, weights = dict(run["grads"]), dict(run["weights"])
    tied_copy = (grads.pop("tied_copy", None), weights.pop("tied_copy", None))
    _close_dicts(grads, ref["grads"], "grad")
    _close_dicts(weights, ref["weights"], "weight")
    for k in ("probe_before", "probe_after"):
        assert _max_diff(run[k], ref[k]) <= TOL, k
    if SPECS[name].get("pp", 1) > 1 and SPECS[name].get("tied"):
        # The last stage's own copy of the tied embedding got the summed gradient and the same step.
        assert _max_diff(tied_copy[0], ref["grads"]["model.embed_tokens.weight"]) <= TOL
        assert _max_diff(tied_copy[1], ref["weights"]["model.embed_tokens.weight"]) <= TOL


@pytest.mark.parametrize("name", [n for n in LAYOUTS + MIXED if SPECS[n].get("pp", 1) > 1])
def test_pipeline_reuses_schedule_for_same_shapes(runs, name):
    """Schedules built: eval L=24, train L=24, train L=16; the second L=16 step and a repeated eval
    reuse the last one (no extra shape-inference pass) and give the same results."""
    assert runs[name]["schedules"] == (4, 4)
    assert torch.equal(runs[name]["probe_again"], runs[name]["probe_after"])


@pytest.mark.parametrize("name", MIXED)
def test_mixed_precision_runs_in_bf16_with_fp32_master_weights(runs, refs, name):
    """bf16 compute (results move off the fp32 reference by bf16 rounding, no more), fp32 weights."""
    run, ref = runs[name], refs(name)
    diffs = [abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)]
    assert max(diffs) > 1e-6 and max(diffs) < 5e-3, diffs
    assert all(t.dtype == torch.float32 for t in run["weights"].values())
    assert 1e-4 < _max_diff(run["probe_before"], ref["probe_before"]) < 5e-2


def test_reference_actually_clips_and_moves(refs):
    """The checks above can fail: clipping scales (norm above the limit) and the step changes weights."""
    ref = refs("t2")
    assert all(n > W.MAX_NORM for n in ref["grad_norms"])
    assert _max_diff(ref["probe_before"], ref["probe_after"]) > 1e-3


def test_activation_checkpointing_recomputes(runs):
    assert runs["t2_qwen3_ac"]["mlp_calls"] == 2 * runs["t2"]["mlp_calls"]
    assert runs["p2_1f1b_ac"]["mlp_calls"] > runs["p2_1f1b"]["mlp_calls"]


def test_vocab_parallel_logprobs_entropy_and_grads(runs):
    """t=2 vocab slices (even 256 and uneven 251) vs the full-vocabulary log-softmax at T=0.7."""
    for vocab, d in runs["vocab"].items():
        assert d["lp"] <= TOL and d["ent"] <= TOL, (vocab, d)
        assert d["grad"] <= TOL and d["grad_scale"] > 0.1, (vocab, d)


def test_typed_errors(runs):
    err = runs["errors"]
    name, msg = err["no_plan"]
    assert name == "NoTensorParallelPlan" and "mistral" in msg
    for fam in ("qwen2", "qwen3", "llama"):
        assert fam in msg
    assert err["schedule"][0] == "ConfigError" and "Interleaved1F1B" in err["schedule"][1]
    assert err["layers"][0] == "ConfigError"
    assert err["world"][0] == "ConfigError" and "3 processes" in err["world"][1]
    assert err["dims"][0] == "ConfigError"


def test_mesh_coordinates(runs):
    """tp innermost, pp outermost; one data-parallel head per replica; FSDP over dp×cp."""
    coords = runs["d2t2"]["coords"]  # (pp, dp, cp, tp) = (1, 2, 1, 2)
    for c in coords:
        assert c["rank"] == c["dp"] * 2 + c["tp"]
        assert c["tp_ranks"] == [c["dp"] * 2, c["dp"] * 2 + 1]
        assert c["fsdp_ranks"] == [c["tp"], 2 + c["tp"]]
        assert c["head"] == (c["tp"] == 0)
        assert c["head_rank"] == c["dp"] * 2
    coords = runs["d2p2"]["coords"]  # (2, 2, 1, 1)
    for c in coords:
        assert c["rank"] == c["pp"] * 2 + c["dp"]
        assert c["head"] == (c["pp"] == 0)
        assert c["head_rank"] == c["dp"]


def test_layer_split_and_microbatch_counts():
    from areal_cli.engines.archon import pipeline

    assert pipeline.split_layers(4, 2) == [(0, 2), (2, 4)]
    assert pipeline.split_layers(5, 2) == [(0, 2), (2, 5)]
    assert pipeline.split_layers(4, 4, [1, 2, 0, 1]) == [(0, 1), (1, 3), (3, 3), (3, 4)]
    assert pipeline.stage_ids(1, 2, 2) == [1, 3]
    assert pipeline.valid_microbatch_count("1F1B", 4, 2) == 4
    assert pipeline.valid_microbatch_count("GPipe", 4, 2) == 2
    assert pipeline.valid_microbatch_count("Interleaved1F1B", 2, 5) == 6


def test_bucket_length():
    """The engine pads a step's micro-batches to a bucket, so that steps of similar lengths reuse the
    schedule: eight buckets per power of two (at least 64 tokens wide), a multiple of cp·tp, capped."""
    from areal_cli.engines.archon.pipeline import bucket_length

    assert [bucket_length(n) for n in (1, 64, 65, 128, 129, 500, 513, 1000, 1025)] == \
        [64, 64, 128, 128, 192, 512, 576, 1024, 1152]
    assert all(bucket_length(n) - n < max(64, n / 8) for n in range(1, 5000))  # padding stays small
    assert len({bucket_length(n) for n in range(900, 1025)}) == 2  # a hundred lengths, two schedules
    assert bucket_length(100, 3) == 129 and bucket_length(100, 3) % 3 == 0
    assert bucket_length(930, 2, cap=950) == 950  # never past the micro-batch token budget…
    assert bucket_length(1000, 1, cap=900) == 1000  # …unless the row itself is longer


def test_pad_stack_masks():
    from areal_cli.engines.archon.pipeline import pad_stack, pad_stack_masks

    a = torch.ones(1, 3, dtype=torch.long)
    b = torch.ones(2, 5, dtype=torch.long)
    out = pad_stack([a, b], value=7)
    assert out.shape == (3, 5) and out[0].tolist() == [1, 1, 1, 7, 7]
    m = pad_stack_masks([torch.ones(1, 1, 3, 3, dtype=torch.bool).tril(),
                         torch.ones(2, 1, 5, 5, dtype=torch.bool)])
    assert m.shape == (3, 1, 5, 5)
    assert m[0, 0, 4].tolist() == [False, False, False, False, True]  # a padded query sees itself only
    assert m[0, 0, 2].tolist() == [True, True, True, False, False]
