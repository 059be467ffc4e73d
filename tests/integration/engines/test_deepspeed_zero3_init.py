"""ZeRO-3 never materialises the full model on a rank (gloo, CPU, d2).

The engine builds the model from its config inside ``deepspeed.zero.Init`` (``from_pretrained`` is made
to raise), rank 0 alone reads the checkpoint, bucket by bucket, and no rank ever holds more than about
half of the parameters plus one module or bucket. After ``initialize`` every parameter is a partition of
``ceil(numel / 2)`` elements, the exported weights are the checkpoint's, the embedding and head stay tied,
and the buffers (rotary ``inv_freq``) equal ``from_pretrained``'s. With bf16 compute over fp32 weights
the fp32 masters are the checkpoint's too, and rank 1 reads only row slices holding its partitions
(about half the elements), never a whole tensor. One launch of two processes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is installed by scripts/install_test_deps.sh")

from engine_reference import untie
from fsdp_worker import launch
from support_paths import SUPPORT

# multi-process engine layouts against their references: CI's `engines` phase (pytest -m engines tests/integration)
pytestmark = pytest.mark.engines

# 0.02M-element buckets: the 0.27M-parameter model loads in many gathers, each at most the embedding
ENGINE = {"deepspeed": {"zero_stage": 3, "param_persistence_threshold": 0, "bucket_mel": 0.02}}


@pytest.fixture(scope="module")
def runs(model4, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_zero3_init")
    variants = [{"name": "fp32", "parallel": {"dp": 2}, "engine": ENGINE},
                {"name": "mp", "parallel": {"dp": 2}, "engine": {**ENGINE, "dtype": "bfloat16"}}]
    launch({"model_dir": model4, "out": str(out), "variants": variants}, 2, timeout=600,
           script=str(SUPPORT / "deepspeed_init_worker.py"))
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


@pytest.mark.parametrize("name", ["fp32", "mp"])
def test_no_rank_holds_the_whole_model(runs, name):
    total = runs[f"{name}_rank0"]["ref_total"]
    for rank in (0, 1):
        r = runs[f"{name}_rank{rank}"]
        # a partition of every parameter, nothing whole left over
        for pname, (numel, local, data) in r["partitions"].items():
            assert local == -(-numel // 2) and data == 0, (rank, pname, numel, local, data)
        assert r["resident_after"] <= total // 2 + len(r["partitions"]) and r["strays"] == 0
        # while building and loading: half the model plus one module (the embedding, 0.08 of it) or one
        # bucket gathered at a time, far from the whole
        assert r["peak"] < 0.7 * total, (rank, r["peak"], total)


def test_only_rank0_reads_the_checkpoint(runs):
    r0, r1 = runs["fp32_rank0"], runs["fp32_rank1"]
    assert r1["reads"] == {"get": 0, "rows": 0, "elements": 0}
    # each tensor once (the tied head is the embedding, not read twice)
    assert r0["reads"]["get"] == len(r0["partitions"]) and r0["reads"]["elements"] == r0["ref_total"]


def test_fp32_masters_come_from_row_slices_of_the_own_partition(runs):
    """bf16 compute: the masters are put back from the checkpoint, each rank reading only the rows that
    hold its partition, so rank 1 reads about half of the model and never a whole tensor."""
    r1, total = runs["mp_rank1"], runs["mp_rank0"]["ref_total"]
    assert r1["reads"]["get"] == 0 and 0 < r1["reads"]["elements"] < 0.6 * total, r1["reads"]


@pytest.mark.parametrize("name", ["fp32", "mp"])
def test_weights_buffers_and_tie_match_from_pretrained(runs, name):
    r, ref = runs[f"{name}_rank0"], runs["fp32_rank0"]
    assert r["tied"]
    got, want = untie(dict(r["weights"])), untie(dict(ref["ref_weights"]))
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for k in want:  # fp32, and in mp the fp32 masters: the checkpoint's values exactly
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), (name, k)
    assert r["buffers"].keys() == ref["ref_buffers"].keys()
    for k, b in ref["ref_buffers"].items():
        assert r["buffers"][k].dtype == b.dtype and torch.equal(r["buffers"][k], b), (name, k)


def test_an_fp32_module_is_not_held_twice(runs):
    """fp32: the optimizer steps the module's own partitions (DeepSpeed would copy them: share_fp32_partitions);
    bf16 compute: the fp32 masters are a separate copy of the bf16 module's partitions, as they must be."""
    for rank in (0, 1):
        assert runs[f"fp32_rank{rank}"]["shares"] and all(runs[f"fp32_rank{rank}"]["shares"])
        assert runs[f"mp_rank{rank}"]["shares"] and not any(runs[f"mp_rank{rank}"]["shares"])
