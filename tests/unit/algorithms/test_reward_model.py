"""The Bradley–Terry loss, the reward read-out and the two-pass surrogate whose gradient is the pair loss's."""

from __future__ import annotations

import math

import pytest
import torch

from areal_cli.algorithms.reward_model import (
    COEF_KEY,
    SHARE_KEY,
    bradley_terry_loss,
    make_pair_batch,
    pair_stats,
    row_coefficients,
    sequence_rewards,
    surrogate_loss_fn,
    surrogate_weight_fn,
)


def test_loss_and_stats_by_hand():
    rc, rr = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss, st = bradley_terry_loss(rc, rr)
    want = (-math.log(1 / (1 + math.exp(-2))) + math.log(2) - math.log(1 / (1 + math.exp(2)))) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert st["accuracy"] == pytest.approx(1 / 3)  # a tie is not a win
    assert st["margin"] == pytest.approx(0.0)
    assert st["chosen"] == pytest.approx(1 / 3) and st["rejected"] == pytest.approx(1 / 3)


def test_loss_is_shift_invariant_and_rejects_bad_shapes():
    rc, rr = torch.randn(5), torch.randn(5)
    assert bradley_terry_loss(rc + 3.0, rr + 3.0)[0].item() == pytest.approx(bradley_terry_loss(rc, rr)[0].item())
    with pytest.raises(ValueError):
        bradley_terry_loss(torch.zeros(2, 1), torch.zeros(2, 1))


def test_pair_batch_reads_the_token_before_the_read_token():
    pairs = [{"chosen_ids": [5, 6, 7], "rejected_ids": [5, 8]}, {"chosen_ids": [9], "rejected_ids": [9, 9, 9, 9]}]
    b = make_pair_batch(pairs, read_token_id=3, pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 3, 0], [5, 8, 3, 0, 0], [9, 3, 0, 0, 0], [9, 9, 9, 9, 3]]
    assert b["loss_mask"].sum(dim=1).tolist() == [1, 1, 1, 1]
    values = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    # the value at the read token's position is the head on the last text token (values are shifted)
    assert sequence_rewards(values, b["attention_mask"]).tolist() == [3.0, 7.0, 11.0, 19.0]


def test_surrogate_gradient_equals_the_pair_loss_gradient_under_any_split():
    """Pass 1's coefficients make ``Σ c·r`` over micro-batches (here one row each, as a split might cut a
    pair) have exactly the Bradley–Terry loss's gradient."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, generator=g, requires_grad=True)
    feats = torch.randn(6, 4, generator=g)  # 3 pairs, interleaved chosen/rejected

    def rewards():
        return feats @ w

    loss, _ = bradley_terry_loss(rewards()[0::2], rewards()[1::2])
    (want,) = torch.autograd.grad(loss, w)
    coef = row_coefficients(rewards().detach(), n_pairs_total=3)
    share = torch.full((6,), 1 / 6, dtype=torch.float64)
    am = torch.ones(6, 2, dtype=torch.bool)
    total = 0.0
    for i in range(6):  # one micro-batch per row; the engine scales each by weight / global weight (1)
        r = rewards()[i:i + 1]
        values = torch.stack([torch.zeros_like(r), r], dim=1)  # [1, 2]: the read token's value is r
        mb = {"attention_mask": am[i:i + 1], COEF_KEY: coef[i:i + 1], SHARE_KEY: share[i:i + 1]}
        part, _ = surrogate_loss_fn({"values": values}, mb)
        total = total + part * surrogate_weight_fn(mb)
    (got,) = torch.autograd.grad(total, w)
    assert torch.allclose(got, want, atol=1e-7), (got, want)


def test_pair_stats_without_an_engine():
    st = pair_stats(None, torch.tensor([1.0, 0.0, 0.0, 2.0]))
    assert st["rm/pairs"] == 2 and st["rm/accuracy"] == 0.5 and st["rm/margin"] == pytest.approx(-0.5)
