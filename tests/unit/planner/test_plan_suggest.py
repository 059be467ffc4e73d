"""``areal plan --suggest`` (planner/suggest.py): the split it returns is one the real validator accepts,
predicted at least as fast as the current spec, and fits in memory."""

from __future__ import annotations

import dataclasses

import pytest

from areal_cli.cli.common import compose_and_validate
from areal_cli.plan.validate import validate
from areal_cli.allocation.hardware import get_profile
from areal_cli.planner.model import plan_config
from areal_cli.planner.suggest import candidate_specs, suggest

EXAMPLE = ["algo=grpo", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2", "cluster=gpu_2x8",
           "model=qwen2_5_7b"]


@pytest.fixture(autouse=True)
def _no_saved_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HARDWARE_DIR", str(tmp_path / "hw"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_suggest_on_the_two_node_example_returns_a_valid_faster_split():
    cfg, plan = compose_and_validate(EXAMPLE)
    hw = get_profile("h100")
    sug = suggest(cfg, plan, hw)
    assert sug.current.spec == "sglang:d4+megatron:d2t2p2"
    assert sug.searched > 10 and sug.best.fits
    assert sug.best.samples_per_s >= sug.current.samples_per_s and sug.gain >= 1.0
    assert sug.override == f"allocation_mode={sug.best.spec}"
    # the suggested spec goes through the real validator and the model gives the same prediction again
    cfg2 = dataclasses.replace(cfg, allocation_mode=dataclasses.replace(cfg.allocation_mode, spec=sug.best.spec))
    again = plan_config(cfg2, validate(cfg2), hw)
    assert again.samples_per_s == pytest.approx(sug.best.samples_per_s) and again.fits
    assert [c.samples_per_s for c in sug.candidates] == sorted((c.samples_per_s for c in sug.candidates),
                                                                 reverse=True)


def test_candidates_keep_the_backends_and_the_models_divisibility():
    cfg, plan = compose_and_validate(EXAMPLE)
    specs = candidate_specs(cfg, plan)
    assert specs[0] == plan.spec and len(specs) == len(set(specs))
    for s in specs[1:]:
        inf, train = s.split("+")
        assert inf.startswith("sglang:") and train.startswith("megatron:")
        assert "t8" not in train  # 4 KV heads: a trainer cannot shard them 8 ways
        assert "p3" not in train  # 28 layers


def test_suggest_on_the_embedded_default_keeps_its_only_split():
    cfg, plan = compose_and_validate([])
    sug = suggest(cfg, plan, get_profile("cpu"))
    assert sug.best.spec == sug.current.spec == "hf:d1+fsdp:d1" and sug.gain == pytest.approx(1.0)
