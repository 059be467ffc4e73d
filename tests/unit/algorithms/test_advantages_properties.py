"""Property tests (hypothesis) tying the estimators and aggregations to their defining identities."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_cli.algorithms.advantages import compute_advantages
from areal_cli.algorithms.losses import ppo_policy_loss
from areal_cli.algorithms.normalisation import aggregate_loss, count_units

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def grouped_batch(draw):
    n_groups = draw(st.integers(1, 4))
    g = draw(st.integers(2, 5))
    L = draw(st.integers(1, 6))
    rewards = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]), min_size=n_groups * g,
                            max_size=n_groups * g))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=L, max_size=L), min_size=n_groups * g,
                         max_size=n_groups * g))
    mask_t = torch.tensor(mask, dtype=torch.float32)
    mask_t[:, -1] = 1.0  # every sequence has at least one trained token
    return torch.tensor(rewards), mask_t, g


def per_seq(adv, mask):
    return (adv * mask).sum(-1) / mask.sum(-1)


@SETTINGS
@given(grouped_batch())
def test_grpo_group_means_are_zero_and_stds_one(b):
    r, mask, g = b
    adv, _ = compute_advantages("grpo", rewards=r, loss_mask=mask, group_size=g)
    a = per_seq(adv, mask).view(-1, g)
    assert torch.allclose(a.mean(1), torch.zeros(a.shape[0]), atol=1e-5)
    spread = r.view(-1, g).std(1) > 0
    if spread.any():
        assert torch.allclose(a[spread].std(1), torch.ones(int(spread.sum())), atol=1e-4)


@SETTINGS
@given(grouped_batch())
def test_rloo_is_scaled_group_centering(b):
    r, mask, g = b
    adv, _ = compute_advantages("rloo", rewards=r, loss_mask=mask, group_size=g)
    centred = (r.view(-1, g) - r.view(-1, g).mean(1, keepdim=True)).view(-1)
    assert torch.allclose(per_seq(adv, mask), centred * g / (g - 1), atol=1e-5)


@SETTINGS
@given(grouped_batch(), st.floats(0.5, 1.0))
def test_gae_with_zero_values_and_lam1_is_discounted_reward_to_go(b, gamma):
    r, mask, _ = b
    adv, ret = compute_advantages("gae", rewards=r, loss_mask=mask, values=torch.zeros_like(mask),
                                  gamma=gamma, lam=1.0, group_size=1)
    _, ret_pp = compute_advantages("reinforce_pp", rewards=r, loss_mask=mask, gamma=gamma, group_size=1)
    assert torch.allclose(adv, ret, atol=1e-6)
    assert torch.allclose(ret, ret_pp, atol=1e-6)


@SETTINGS
@given(grouped_batch(), st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
       st.data())
def test_aggregation_split_invariance(b, mode, data):
    _, mask, _ = b
    B, L = mask.shape
    loss = torch.arange(B * L, dtype=torch.float32).view(B, L) / 7.0
    cut = data.draw(st.integers(1, B)) if B > 1 else 1
    parts = [(loss[:cut], mask[:cut]), (loss[cut:], mask[cut:])]
    parts = [(x, m) for x, m in parts if x.shape[0] > 0]
    total = sum(count_units(m, mode) for _, m in parts)
    combined = sum(aggregate_loss(x, m, mode) * count_units(m, mode) / total for x, m in parts)
    assert torch.allclose(combined, aggregate_loss(loss, mask, mode), atol=1e-5)


@SETTINGS
@given(grouped_batch())
def test_on_policy_ppo_gradient_is_policy_gradient(b):
    # At ratio 1 nothing is clipped: d loss / d logp_t = -A_t / #tokens (token-mean).
    r, mask, g = b
    adv, _ = compute_advantages("grpo", rewards=r, loss_mask=mask, group_size=g)
    logp = torch.full_like(mask, -1.0, requires_grad=True)
    loss_tok, _ = ppo_policy_loss(logp, logp.detach(), adv, mask.bool())
    aggregate_loss(loss_tok, mask, "token-mean").backward()
    assert torch.allclose(logp.grad, -adv * mask / mask.sum(), atol=1e-6)
