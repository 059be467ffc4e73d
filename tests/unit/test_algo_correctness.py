"""Issue 22, algorithms: exact-zero advantages for equal rewards, one KL clamp default, DAPO's
overlong penalty per turn, Dr.GRPO's constant normaliser, group-size-1 config errors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_cli.algorithms.advantages import compute_advantages

EQUAL_REWARD_ESTIMATORS = [
    ("grpo", {"mean_level": "group", "std_level": "group"}),
    ("grpo", {"mean_level": "batch", "std_level": "batch"}),
    ("grpo", {"mean_level": "group", "std_level": "batch"}),
    ("drgrpo", {}),
    ("rloo", {}),
    ("reinforce_pp_baseline", {}),
]

_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(value=_finite, group_size=st.integers(2, 64), n_groups=st.integers(1, 4),
       mixed=st.floats(min_value=-5, max_value=5, allow_nan=False, width=32))
def test_equal_rewards_give_exactly_zero_advantages(value, group_size, n_groups, mixed):
    """A group whose rewards are all equal carries no signal: every estimator that centres on a
    group (or batch) mean must give exactly 0, whatever the value (0.7 used to give |A| ~ 0.06)."""
    B = group_size * n_groups
    mask = torch.ones(B, 3)
    rewards = torch.full((B,), value, dtype=torch.float32)
    for name, kw in EQUAL_REWARD_ESTIMATORS:
        adv, _ = compute_advantages(name, rewards=rewards, loss_mask=mask, group_size=group_size, **kw)
        assert torch.equal(adv, torch.zeros_like(adv)), (name, kw, value, float(adv.abs().max()))
    # Group-level estimators: an equal group next to a non-equal one still gets exact zeros.
    if n_groups >= 2:
        rewards = rewards.clone()
        rewards[group_size:2 * group_size] = torch.linspace(mixed, mixed + 1.0, group_size)
        for name, kw in EQUAL_REWARD_ESTIMATORS:
            if kw.get("mean_level") == "batch" or name == "reinforce_pp_baseline":
                continue  # batch statistics mix the groups; whitening then shifts every row
            adv, _ = compute_advantages(name, rewards=rewards, loss_mask=mask, group_size=group_size, **kw)
            assert torch.equal(adv[:group_size], torch.zeros_like(adv[:group_size])), (name, kw, value)


def test_equal_rewards_07_regression():
    rewards = torch.full((8,), 0.7)
    adv, _ = compute_advantages("grpo", rewards=rewards, loss_mask=torch.ones(8, 2), group_size=8)
    assert float(adv.abs().max()) == 0.0


# --- item 3: group size 1 ---------------------------------------------------------------------

import pytest  # noqa: E402

from areal_cli.config.compose import load_config  # noqa: E402
from areal_cli.config.validate import validate  # noqa: E402
from areal_cli.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize("overrides", [
    ["algo=grpo"],
    ["algo=drgrpo"],
    ["algo=rloo"],
    ["algo=reinforce_pp", "algo.adv_estimator=reinforce_pp_baseline"],
    ["algo=grpo", "algo.mean_level=batch"],  # std over a group of one is 0: A = (r - mean) / eps
    ["algo=dapo", "algo.ppo_n_minibatches=1"],  # dynamic sampling drops every group of one (its rewards are trivially equal)
])
def test_group_size_one_is_a_config_error(overrides):
    """With one sample per prompt the group baseline is the sample itself: training would run on
    zero advantages (only KL and entropy gradients). validate-config must refuse it."""
    with pytest.raises(ConfigError) as ei:
        validate(load_config([*overrides, "rollout.group_size=1"]))
    assert ei.value.path == "rollout.group_size"
    assert "group_size" in ei.value.hint or "rollout.group_size" in ei.value.hint


@pytest.mark.parametrize("overrides", [
    ["algo=reinforce_pp"], ["algo=grpo", "algo.mean_level=batch", "algo.std_level=batch"], ["algo=sft"],
])
def test_group_size_one_is_fine_without_a_group_baseline(overrides):
    validate(load_config([*overrides, "rollout.group_size=1"]))
