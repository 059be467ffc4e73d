"""Sweep expansion uses Hydra's own parser: grids, ranges, choices, globs and optuna distributions."""

from __future__ import annotations

import pytest

from areal_cli.errors import ConfigError, UsageError
from areal_cli.sweep.expand import expand_grid, group_options, optuna_distributions, split_overrides, trial_id


def test_split_fixed_and_swept():
    spec = split_overrides(["trainer.total_steps=3", "algo.optim.lr=1e-6,3e-6", "algo=grpo,dapo"])
    assert spec.fixed == ["trainer.total_steps=3"]
    assert spec.swept_keys == ["algo.optim.lr", "algo"]
    assert not spec.is_search


def test_grid_is_cartesian_product_in_order():
    trials = expand_grid(["algo.optim.lr=1e-6,3e-6", "seed=range(1,4)"])
    assert len(trials) == 6
    assert trials[0] == ["algo.optim.lr=1e-06", "seed=1"]
    assert trials[-1] == ["algo.optim.lr=3e-06", "seed=3"]


def test_unquoted_raw_specs_come_back_quoted_not_escaped():
    trials = expand_grid(["allocation_mode=hf:d1+fsdp:d1,sglang.d4+megatron.d2t2p2"])
    assert trials == [["allocation_mode='hf:d1+fsdp:d1'"], ["allocation_mode='sglang.d4+megatron.d2t2p2'"]]


def test_choice_and_raw_allocation_specs():
    trials = expand_grid(["allocation_mode='hf:d1+fsdp:d1','sglang.d4+megatron.d2t2p2'", "x=choice(a,b)"])
    # Hydra keeps the quotes, so each trial's override parses again unchanged in `areal train`.
    assert [t[0] for t in trials[::2]] == ["allocation_mode='hf:d1+fsdp:d1'", "allocation_mode='sglang.d4+megatron.d2t2p2'"]
    assert {t[1] for t in trials} == {"x=a", "x=b"}


def test_glob_over_a_config_group():
    opts = group_options("algo")
    if not opts:
        pytest.skip("conf/algo not present")
    trials = expand_grid(["algo=glob(*grpo*)"])
    names = sorted(t[0].split("=")[1] for t in trials)
    assert names == sorted(o for o in opts if "grpo" in o)
    assert names, "at least grpo should match"


def test_glob_on_a_plain_key_is_a_config_error():
    with pytest.raises(ConfigError, match="config group"):
        expand_grid(["algo.optim.lr=glob(*)"])


def test_interval_marks_a_search_and_maps_to_optuna():
    spec = split_overrides(["algo.optim.lr=tag(log,interval(1e-5,1e-3))", "seed=choice(1,2)"])
    assert spec.is_search
    dists = optuna_distributions(spec.swept)
    assert type(dists["algo.optim.lr"]).__name__ == "LogUniformDistribution"
    assert dists["algo.optim.lr"].low == pytest.approx(1e-5)
    assert type(dists["seed"]).__name__ == "CategoricalDistribution"
    with pytest.raises(UsageError):
        expand_grid(spec.swept)


def test_bad_override_is_typed():
    with pytest.raises(ConfigError) as e:
        split_overrides(["algo.optim.lr=[1,"])
    assert e.value.path == "algo.optim.lr"


def test_trial_ids_are_stable_and_order_free():
    assert trial_id(["a=1", "b=2"]) == trial_id(["b=2", "a=1"])
    assert trial_id(["a=1"]) != trial_id(["a=2"])
