"""Hand-computed checks of every advantage estimator (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from areal_cli.algorithms.advantages import (
    compute_advantages,
    discounted_returns,
    last_token_index,
    overlong_penalty,
    token_level_rewards,
)
from areal_cli.algorithms.registry import ADV_ESTIMATORS
from areal_cli.errors import ConfigError


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# 4 sequences, group_size 2: groups (1, 0) and (1, 1). Trained tokens vary per row.
REWARDS = t([1.0, 0.0, 1.0, 1.0])
MASK = t([[0, 1, 1], [0, 1, 0], [0, 0, 1], [0, 1, 1]])
S = 1 / math.sqrt(2)  # 0.5 / unbiased std of (1, 0) = 0.5 / sqrt(0.5) = 0.70711


def near(x, expect, tol=1e-5):
    torch.testing.assert_close(x.float(), t(expect), atol=tol, rtol=0)


def seq_adv(adv):
    """The per-sequence value an outcome estimator broadcast over its row's trained tokens."""
    out = []
    for row, m in zip(adv, MASK):
        vals = row[m.bool()]
        assert torch.allclose(vals, vals[0].expand_as(vals))
        out.append(float(vals[0]))
    return out


def test_grpo_group_group_unbiased():
    adv, ret = compute_advantages("grpo", rewards=REWARDS, loss_mask=MASK, group_size=2)
    # group 1: mean 0.5, std sqrt(((.5)^2+(.5)^2)/1) = 0.70711 → ±0.70711 ; group 2: 0/(0+eps) = 0
    assert seq_adv(adv) == pytest.approx([S, -S, 0.0, 0.0], abs=1e-5)
    assert ret is None
    assert torch.all(adv[MASK == 0] == 0)


def test_grpo_biased_std():
    adv, _ = compute_advantages("grpo", rewards=REWARDS, loss_mask=MASK, group_size=2, std_unbiased=False)
    # biased std of (1, 0) = 0.5 → ±0.5/0.5 = ±1
    assert seq_adv(adv) == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_grpo_batch_mean_no_std():
    adv, _ = compute_advantages("grpo", rewards=REWARDS, loss_mask=MASK, group_size=2,
                                mean_level="batch", std_level="none")
    # batch mean (1+0+1+1)/4 = 0.75
    assert seq_adv(adv) == pytest.approx([0.25, -0.75, 0.25, 0.25], abs=1e-6)


def test_grpo_group_mean_batch_std():
    adv, _ = compute_advantages("grpo", rewards=REWARDS, loss_mask=MASK, group_size=2,
                                mean_level="group", std_level="batch")
    # batch std: deviations from .75 squared: .0625+.5625+.0625+.0625 = .75, /3 = .25 → std .5
    # group 1: ±0.5/0.5 = ±1 ; group 2: 0
    assert seq_adv(adv) == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_grpo_no_mean_no_std_is_raw_reward():
    adv, _ = compute_advantages("grpo", rewards=REWARDS, loss_mask=MASK, group_size=2,
                                mean_level="none", std_level="none")
    assert seq_adv(adv) == pytest.approx([1.0, 0.0, 1.0, 1.0])


def test_grpo_token_rewards_enter_sequence_score():
    tok = torch.zeros_like(MASK)
    tok[0, 1], tok[0, 2] = -0.25, -0.25  # KL-in-reward: sequence 0 scores 1 - 0.5 = 0.5
    adv, _ = compute_advantages("grpo", rewards=REWARDS, loss_mask=MASK, group_size=2,
                                token_rewards=tok, std_level="none")
    # group 1 scores (0.5, 0): mean 0.25 → (0.25, -0.25)
    assert seq_adv(adv) == pytest.approx([0.25, -0.25, 0.0, 0.0], abs=1e-6)


def test_grpo_rejects_split_group():
    with pytest.raises(ValueError, match="group"):
        compute_advantages("grpo", rewards=t([1.0, 0.0, 1.0]), loss_mask=torch.ones(3, 2), group_size=2)


def test_drgrpo_group_mean_without_std():
    adv, _ = compute_advantages("drgrpo", rewards=REWARDS, loss_mask=MASK, group_size=2)
    # group means 0.5 and 1 → (0.5, -0.5, 0, 0); no std division even though group 1 std = 0.707
    assert seq_adv(adv) == pytest.approx([0.5, -0.5, 0.0, 0.0], abs=1e-6)


def test_rloo_leave_one_out():
    r = t([1.0, 0.0, 2.0, 3.0, 3.0, 0.0])
    mask = torch.ones(6, 2)
    adv, _ = compute_advantages("rloo", rewards=r, loss_mask=mask, group_size=3)
    # group (1, 0, 2): 1-(0+2)/2 = 0 ; 0-(1+2)/2 = -1.5 ; 2-(1+0)/2 = 1.5
    # group (3, 3, 0): 3-1.5 = 1.5 ; 1.5 ; 0-3 = -3
    assert adv[:, 0].tolist() == pytest.approx([0.0, -1.5, 1.5, 1.5, 1.5, -3.0])
    assert torch.equal(adv[:, 0], adv[:, 1])
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("rloo", rewards=r, loss_mask=mask, group_size=1)


def test_token_level_rewards_and_last_index():
    mask = t([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 3, 0]
    out = token_level_rewards(t([1.0, 2.0, 5.0]), mask)
    # reward lands on the last trained token; a row without trained tokens gets nothing
    near(out, [[0, 0, 1, 0], [0, 0, 0, 2], [0, 0, 0, 0]])


def test_discounted_returns_skip_untrained_tokens():
    # tokens 1 and 3 trained, 2 is an observation (multi-turn): G3 = 1, G1 = 0 + 0.5 * 1 = 0.5
    mask = t([[0, 1, 0, 1]])
    ret = discounted_returns(t([[0, 0, 0, 1]]), mask, gamma=0.5)
    assert ret.tolist() == [[0.0, 0.5, 0.0, 1.0]]


def test_reinforce_pp_whitened_returns():
    rewards = t([1.0, 0.0])
    mask = t([[0, 1, 1], [0, 1, 1]])
    kl_tok = t([[0, -0.1, -0.2], [0, -0.3, 0.0]])
    adv, ret = compute_advantages("reinforce_pp", rewards=rewards, loss_mask=mask, token_rewards=kl_tok,
                                  gamma=1.0, group_size=1)
    # token rewards: row0 [0, -.1, -.2+1 = .8], row1 [0, -.3, 0]
    # returns (gamma 1): row0 [.7, .8], row1 [-.3, 0]
    near(ret[:, 1:], [[0.7, 0.8], [-0.3, 0.0]], 1e-6)
    # mean 1.2/4 = .3 ; devs .4 .5 -.6 -.3 ; squares sum .86 ; unbiased var .86/3 = .28667 ; std .535413
    sd = math.sqrt(0.86 / 3)
    expect = [[0.4 / sd, 0.5 / sd], [-0.6 / sd, -0.3 / sd]]
    near(adv[:, 1:], expect)
    assert adv[:, 0].tolist() == [0.0, 0.0]
    _, ret_half = compute_advantages("reinforce_pp", rewards=rewards, loss_mask=mask, token_rewards=kl_tok,
                                     gamma=0.5, group_size=1)
    # gamma .5: row0 G2 = .8, G1 = -.1 + .5*.8 = .3
    assert ret_half[0, 1:].tolist() == pytest.approx([0.3, 0.8], abs=1e-6)


def test_reinforce_pp_baseline():
    rewards = t([1.0, 0.0, 1.0, 1.0])
    mask = t([[1, 1], [1, 0], [1, 0], [1, 0]])
    adv, _ = compute_advantages("reinforce_pp_baseline", rewards=rewards, loss_mask=mask, group_size=2)
    # minus group mean: (.5, -.5, 0, 0); token values .5 .5 -.5 0 0 → mean .1
    # devs .4 .4 -.6 -.1 -.1 ; squares .70 ; unbiased var .70/4 = .175 ; std .418330
    sd = math.sqrt(0.175)
    near(adv, [[0.4 / sd, 0.4 / sd], [-0.6 / sd, 0.0], [-0.1 / sd, 0.0],
                                          [-0.1 / sd, 0.0]], 1e-5)


def test_gae_gamma1_lam09():
    mask = t([[0, 1, 1, 1]])
    values = t([[0.0, 0.5, 0.6, 0.7]])
    adv, ret = compute_advantages("gae", rewards=t([1.0]), loss_mask=mask, values=values, gamma=1.0,
                                  lam=0.9, group_size=1)
    # t3: delta = 1 + 0 - .7 = .3 → A3 = .3
    # t2: delta = 0 + .7 - .6 = .1 → A2 = .1 + .9*.3 = .37
    # t1: delta = 0 + .6 - .5 = .1 → A1 = .1 + .9*.37 = .433
    near(adv, [[0.0, 0.433, 0.37, 0.3]], 1e-6)
    # returns = A + V: .933, .97, 1.0
    near(ret, [[0.0, 0.933, 0.97, 1.0]], 1e-6)


def test_gae_lam1_gives_discounted_monte_carlo_returns():
    mask = t([[0, 1, 1, 1]])
    values = t([[0.0, 0.5, 0.6, 0.7]])
    adv, ret = compute_advantages("gae", rewards=t([1.0]), loss_mask=mask, values=values, gamma=0.9,
                                  lam=1.0, group_size=1)
    # t3: .3 ; t2: delta .9*.7-.6 = .03 → .03+.9*.3 = .30 ; t1: delta .9*.6-.5 = .04 → .04+.9*.30 = .31
    assert adv[0, 1:].tolist() == pytest.approx([0.31, 0.30, 0.3], abs=1e-6)
    # returns 1*.9^2, .9, 1
    assert ret[0, 1:].tolist() == pytest.approx([0.81, 0.9, 1.0], abs=1e-6)


def test_gae_skips_observation_tokens_and_uses_kl_rewards():
    mask = t([[1, 0, 1]])
    values = t([[0.2, 9.0, 0.4]])  # the observation's value must be ignored
    kl_tok = t([[-0.1, 0.0, 0.0]])
    adv, _ = compute_advantages("gae", rewards=t([1.0]), loss_mask=mask, values=values, token_rewards=kl_tok,
                                gamma=1.0, lam=1.0, group_size=1)
    # t2: r = 1, delta = 1 - .4 = .6 ; t0: r = -.1, delta = -.1 + .4 - .2 = .1 → A0 = .1 + .6 = .7
    near(adv, [[0.7, 0.0, 0.6]], 1e-6)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", rewards=t([1.0]), loss_mask=mask, group_size=1)


def test_none_estimator_is_raw_sequence_score():
    adv, _ = compute_advantages("none", rewards=t([2.0, -1.0]), loss_mask=t([[1, 1], [0, 1]]), group_size=1)
    assert adv.tolist() == [[2.0, 2.0], [0.0, -1.0]]


def test_overlong_penalty():
    # max 10, buffer 4 → free up to 6 tokens, then -(len-6)/4 * factor
    lens = t([5, 6, 8, 10])
    assert overlong_penalty(lens, 10, 4, 1.0).tolist() == pytest.approx([0, 0, -0.5, -1.0])
    assert overlong_penalty(t([8, 12]), 10, 4, 2.0).tolist() == pytest.approx([-1.0, -2.0])
    with pytest.raises(ValueError):
        overlong_penalty(lens, 10, 11, 1.0)


def test_registry_unknown_key():
    with pytest.raises(ConfigError, match="use one of: grpo"):
        compute_advantages("ppo2", rewards=REWARDS, loss_mask=MASK, group_size=2)
    assert set(ADV_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                   "gae", "none"}
