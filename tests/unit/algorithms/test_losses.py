"""Hand-computed checks of the policy/value/SFT losses, decoupled PPO and loss aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from areal_cli.algorithms.losses import (
    POLICY_LOSSES,
    ActorLossParams,
    actor_loss,
    behaviour_importance_weights,
    clipped_value_loss,
    gspo_policy_loss,
    loglinear_prox_logp,
    ppo_policy_loss,
    sft_policy_loss,
)
from areal_cli.algorithms.normalisation import aggregate_loss, count_units, masked_whiten


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def near(x, expect, tol=1e-5):
    torch.testing.assert_close(x.float(), t(expect), atol=tol, rtol=0)


RATIOS = [1.5, 0.5, 1.1, 0.7]
ADV = t([[1.0, 1.0, -1.0, -1.0]])
MASK = torch.ones(1, 4, dtype=torch.bool)


def logp_for(ratios, old=-1.0):
    return (t([ratios]).log() + old).requires_grad_(True), torch.full((1, len(ratios)), old)


def test_ppo_clip():
    logp, old = logp_for(RATIOS)
    loss_tok, diag = ppo_policy_loss(logp, old, ADV, MASK, eps_clip=0.2)
    # r=1.5,A=1: max(-1.5, -1.2) = -1.2 (clipped) ; r=.5,A=1: max(-.5, -.8) = -.5
    # r=1.1,A=-1: max(1.1, 1.1) = 1.1 ; r=.7,A=-1: max(.7, .8) = .8 (clipped)
    near(loss_tok, [[-1.2, -0.5, 1.1, 0.8]])
    assert diag["clip_mask"].tolist() == [[True, False, False, True]]
    loss = aggregate_loss(loss_tok, MASK, "token-mean")
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)  # 0.05
    loss.backward()
    # d/dlogp (-A r)/4 = -A r / 4 on unclipped tokens: (0, -.5/4, 1.1/4, 0)
    near(logp.grad, [[0.0, -0.125, 0.275, 0.0]])


def test_ppo_clip_higher():
    logp, old = logp_for([1.5, 0.5])
    loss_tok, _ = ppo_policy_loss(logp, old, t([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool),
                                  eps_clip=0.2, eps_clip_high=0.28)
    # upper bound 1.28: max(-1.5, -1.28) = -1.28 ; lower bound stays .8: max(.5, .8) = .8
    near(loss_tok, [[-1.28, 0.8]])


def test_ppo_dual_clip():
    logp, old = logp_for([5.0, 1.5, 0.5])
    adv = t([[-1.0, 1.0, -2.0]])
    loss_tok, diag = ppo_policy_loss(logp, old, adv, torch.ones(1, 3, dtype=torch.bool), eps_clip=0.2,
                                     c_clip=3.0)
    # r=5,A=-1: max(5, 1.2) = 5 > 3*|A| = 3 → 3 (dual-clipped)
    # r=1.5,A=1: -1.2 (positive advantages are never dual-clipped)
    # r=.5,A=-2: max(1, 1.6) = 1.6 < 6 → 1.6
    near(loss_tok, [[3.0, -1.2, 1.6]])
    assert diag["dual_clip_mask"].tolist() == [[True, False, False]]
    loss_tok.sum().backward()
    assert logp.grad[0, 0].item() == 0.0  # the dual-clipped token carries no gradient


def test_ppo_masked_tokens_contribute_nothing():
    logp, old = logp_for([50.0, 1.0])
    mask = torch.tensor([[False, True]])
    loss_tok, _ = ppo_policy_loss(logp, old, t([[1.0, 1.0]]), mask)
    near(loss_tok, [[0.0, -1.0]])


def test_gspo_sequence_ratio():
    logp = t([[0.2, -0.1, 0.5]]).requires_grad_(True)  # log ratios vs old = 0
    old = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    adv = t([[2.0, 0.0, 7.0]])
    # s = exp(mean(.2, -.1)) = exp(.05) = 1.051271 ; sequence advantage mean(2, 0) = 1
    loss_tok, diag = gspo_policy_loss(logp, old, adv, mask, eps_clip=3e-4, eps_clip_high=4e-4)
    # clip range [.9997, 1.0004]: max(-1.051271, -1.0004) = -1.0004 on both trained tokens
    near(loss_tok, [[-1.0004, -1.0004, 0.0]])
    loss_tok2, _ = gspo_policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.2)
    loss = aggregate_loss(loss_tok2, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-math.exp(0.05), abs=1e-6)
    loss.backward()
    # d(-s)/dlogp_t = -s * 1/2 for both trained tokens
    near(logp.grad, [[-math.exp(0.05) / 2, -math.exp(0.05) / 2, 0.0]])


def test_sft_nll():
    logp = t([[-0.5, -2.0, -1.0]])
    mask = torch.tensor([[False, True, True]])
    nll, _ = sft_policy_loss(logp, None, None, mask)
    assert aggregate_loss(nll, mask, "token-mean").item() == pytest.approx(1.5)  # (2 + 1) / 2


def test_loglinear_prox():
    behav = t([[0.0, -1.0, -1.0, -2.0]])
    cur = t([[0.0, -0.5, -0.4, -0.5]]).requires_grad_(True)
    versions = torch.tensor([[-1, 5, 4, 3]])
    prox = loglinear_prox_logp(behav, cur, versions, current_version=5)
    # v=5 (on-policy): alpha 0 → -1 ; v=4: alpha (5-4)/(6-4) = .5 → -1 + .5*.6 = -.7
    # v=3: alpha (5-3)/(6-3) = 2/3 → -2 + 2/3*1.5 = -1 ; prompt (v=-1): 0
    near(prox, [[0.0, -1.0, -0.7, -1.0]])
    assert not prox.requires_grad  # the proximal policy is a constant in the loss


def test_behaviour_weights_token_level():
    behav = t([[-1.0, -2.0, -0.5]])
    prox = t([[-0.9, -1.0, -0.5]])  # log w = (.1, 1, 0) → w = (1.105171, 2.718282, 1)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, kept = behaviour_importance_weights(prox, behav, mask)
    near(w, [[math.exp(0.1), math.e, 1.0]])
    w, kept = behaviour_importance_weights(prox, behav, mask, cap=2.0, mode="truncate")
    near(w, [[math.exp(0.1), 2.0, 1.0]])
    assert kept.all()
    w, kept = behaviour_importance_weights(prox, behav, mask, cap=2.0, mode="mask")
    near(w, [[math.exp(0.1), 0.0, 1.0]])
    assert kept.tolist() == [[True, False, True]]


def test_behaviour_weights_sequence_level():
    behav = t([[-1.0, -2.0, -0.5]])
    prox = t([[-0.9, -1.0, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    g = math.exp(1.1 / 3)  # geometric mean of the token weights: exp((.1 + 1 + 0) / 3) = 1.442915
    w, _ = behaviour_importance_weights(prox, behav, mask, level="sequence")
    near(w, [[g, g, g]])
    w, _ = behaviour_importance_weights(prox, behav, mask, cap=1.4, mode="truncate", level="sequence")
    near(w, [[1.4, 1.4, 1.4]])
    w, kept = behaviour_importance_weights(prox, behav, mask, cap=1.4, mode="mask", level="sequence")
    near(w, [[0.0, 0.0, 0.0]])
    assert not kept.any()


def test_actor_loss_decoupled_kl_entropy():
    logp = t([[-1.0, -1.0]]).requires_grad_(True)
    mb = {"loss_mask": torch.ones(1, 2), "logprobs": t([[-1.2, -1.0]]), "prox_logp": t([[-1.1, -1.0]]),
          "advantages": t([[1.0, -1.0]]), "ref_logp": t([[-1.0, -1.5]])}
    p = ActorLossParams(use_decoupled_loss=True, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, stats = actor_loss(logp, t([[0.5, 1.0]]), mb, p)
    # ratio vs prox = (e^.1, 1): token0 -1.105171 (inside clip), token1 -(-1)*1 = 1
    # behaviour weight exp(prox - behav) = (e^.1, 1) → pg = (-e^.2 = -1.221403, 1)
    # KL k1 = logp - ref = (0, .5) → +.1*(0, .5) = (0, .05) ; entropy -.01*(.5, 1) = (-.005, -.01)
    expect = ((-math.exp(0.2) - 0.005) + (1 + 0.05 - 0.01)) / 2
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert stats["kl"] == pytest.approx(0.25)
    assert stats["behav_imp_weight"] == pytest.approx((math.exp(0.1) + 1) / 2, abs=1e-6)


def test_actor_loss_needs_prox_for_decoupled_recompute():
    mb = {"loss_mask": torch.ones(1, 1), "logprobs": t([[-1.0]]), "advantages": t([[1.0]])}
    with pytest.raises(ValueError, match="prox_logp"):
        actor_loss(t([[-1.0]]), None, mb, ActorLossParams(use_decoupled_loss=True))


def test_actor_loss_loglinear_on_policy_equals_plain_ppo():
    # on-policy tokens (version == current) make prox == behav, weight 1 → plain PPO against behav
    logp = t([[-0.9, -1.3]])
    mb = {"loss_mask": torch.ones(1, 2), "logprobs": t([[-1.0, -1.0]]), "advantages": t([[1.0, 1.0]]),
          "versions": torch.tensor([[3, 3]])}
    dec, _ = actor_loss(logp, None, mb, ActorLossParams(use_decoupled_loss=True, prox_logp_method="loglinear",
                                                         current_version=3))
    plain, _ = actor_loss(logp, None, mb, ActorLossParams())
    # ratios (e^.1, e^-.3) inside clip: -(1.105171 + .740818)/2
    assert dec.item() == pytest.approx(plain.item())
    assert plain.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.3)) / 2, abs=1e-6)


def test_clipped_value_loss():
    values = t([[1.0, 2.0]]).requires_grad_(True)
    loss_tok, diag = clipped_value_loss(values, t([[0.5, 2.0]]), t([[2.0, 1.0]]), torch.ones(1, 2), 0.2)
    # token0: clipped V = .5 + .2 = .7 ; (1-2)^2 = 1 vs (.7-2)^2 = 1.69 → .5*1.69 = .845
    # token1: V = V_old = 2 ; (2-1)^2 = 1 → .5
    near(loss_tok, [[0.845, 0.5]])
    assert diag["clip_mask"].tolist() == [[True, False]]
    aggregate_loss(loss_tok, torch.ones(1, 2), "token-mean").backward()
    near(values.grad, [[0.0, 0.5]])  # clipped branch is constant in V ; d/dV .5(V-1)^2 / 2 = .5


LOSS = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
AGG_MASK = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third row has no trained tokens


def test_aggregation_modes():
    assert aggregate_loss(LOSS, AGG_MASK, "token-mean").item() == pytest.approx(2.5)  # 10 / 4
    assert aggregate_loss(LOSS, AGG_MASK, "seq-mean-token-sum").item() == pytest.approx(5.0)  # (6+4)/2
    assert aggregate_loss(LOSS, AGG_MASK, "seq-mean-token-mean").item() == pytest.approx(3.0)  # (2+4)/2
    assert count_units(AGG_MASK, "token-mean") == 4
    assert count_units(AGG_MASK, "seq-mean-token-sum") == 2
    assert count_units(AGG_MASK, "seq-mean-token-mean") == 2


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_is_split_invariant_with_unit_weights(mode):
    # The engine computes sum_mb loss_mb * units_mb / sum units; this must equal the full-batch loss.
    full = aggregate_loss(LOSS, AGG_MASK, mode).item()
    for cut in (1, 2):
        parts = [(LOSS[:cut], AGG_MASK[:cut]), (LOSS[cut:], AGG_MASK[cut:])]
        total = sum(count_units(m, mode) for _, m in parts)
        combined = sum(aggregate_loss(x, m, mode).item() * count_units(m, mode) / total for x, m in parts)
        assert combined == pytest.approx(full)


def test_masked_whiten():
    x = t([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    m = t([[1, 1, 0], [1, 1, 0]])
    # masked values 1..4: mean 2.5, unbiased var 5/3 → (x - 2.5) / 1.290994
    sd = math.sqrt(5 / 3)
    near(masked_whiten(x, m), [[-1.5 / sd, -0.5 / sd, 0.0], [0.5 / sd, 1.5 / sd, 0.0]])


def test_policy_registry():
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "sft"}
