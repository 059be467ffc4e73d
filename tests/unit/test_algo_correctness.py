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
