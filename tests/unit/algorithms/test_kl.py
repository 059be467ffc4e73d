"""Hand-computed checks of the k1/k2/k3 KL estimators and KL-in-reward."""

from __future__ import annotations

import math

import pytest
import torch

from areal_cli.algorithms.kl import KL_ESTIMATORS, kl_estimate, kl_reward
from areal_cli.errors import ConfigError

LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])  # log_ratio = logp - ref = (0.5, -1.0)


def test_k1():
    assert kl_estimate(LOGP, REF, "k1").tolist() == pytest.approx([0.5, -1.0])


def test_k2():
    # 0.5 * (0.5)^2 = 0.125 ; 0.5 * (-1)^2 = 0.5
    assert kl_estimate(LOGP, REF, "k2").tolist() == pytest.approx([0.125, 0.5])


def test_k3():
    # ref - logp = (-0.5, 1.0): exp(-.5) - 1 + .5 = .606531 - .5 = .106531 ; e - 1 - 1 = .718282
    assert kl_estimate(LOGP, REF, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.e - 2.0],
                                                                   abs=1e-6)


def test_k3_nonnegative_and_zero_at_equal_policies():
    g = torch.Generator().manual_seed(0)
    a, b = -torch.rand(100, generator=g) * 5, -torch.rand(100, generator=g) * 5
    assert (kl_estimate(a, b, "k3") >= 0).all()
    assert kl_estimate(a, a, "k3").abs().max() == 0


def test_clamp_and_mask():
    # k3 = (.106531, .718282) clamped at .5 ; k1 masked: second token zeroed
    assert kl_estimate(LOGP, REF, "k3", clamp=0.5).tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0.5],
                                                                             abs=1e-6)
    assert kl_estimate(LOGP, REF, "k1", mask=torch.tensor([1.0, 0.0])).tolist() == pytest.approx([0.5, 0.0])


def test_kl_reward_is_negative_coef_times_kl_and_detached():
    logp = LOGP.clone().requires_grad_(True)
    r = kl_reward(logp, REF, torch.tensor([1.0, 1.0]), kl_coef=0.1, estimator="k1")
    # -0.1 * (0.5, -1.0) = (-0.05, 0.1)
    assert r.tolist() == pytest.approx([-0.05, 0.1])
    assert not r.requires_grad


def test_k_gradients_match_hand_derivation():
    # d/dlogp of k1 = 1 ; k2 = (logp-ref) ; k3 = 1 - exp(ref-logp)
    for name, expect in [("k1", [1.0, 1.0]), ("k2", [0.5, -1.0]),
                         ("k3", [1 - math.exp(-0.5), 1 - math.e])]:
        logp = LOGP.clone().requires_grad_(True)
        kl_estimate(logp, REF, name).sum().backward()
        assert logp.grad.tolist() == pytest.approx(expect, abs=1e-6), name


def test_registry():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    with pytest.raises(ConfigError, match="use one of: k1, k2, k3") as ei:
        kl_estimate(LOGP, REF, "k4")
    assert ei.value.path == "algo.kl_estimator"
