"""FFD micro-batching, DP splitting, padding-free packing and LR schedules (pure functions)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_cli.engines import packing
from areal_cli.errors import ConfigError
from areal_cli.utils.optim import lr_factor


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 120))
def test_ffd_bins_partition_and_budget(lengths, budget):
    bins = packing.ffd_bins(lengths, budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    for b in bins:
        load = sum(lengths[i] for i in b)
        assert load <= budget or len(b) == 1  # an oversized sequence gets a bin of its own


def test_ffd_is_first_fit_decreasing():
    # 7 and 5 cannot share a 10-token bin; 3 joins 7, then 5 and 2 share the next.
    assert packing.ffd_bins([5, 7, 3, 2], 10) == [[0, 3], [1, 2]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=20), st.integers(1, 25))
def test_equalize_bins_reaches_target_when_possible(lengths, target):
    bins = packing.ffd_bins(lengths, 10_000)
    out = packing.equalize_bins(bins, lengths, target)
    assert sorted(i for b in out for i in b) == list(range(len(lengths)))
    assert len(out) == min(target, len(lengths))


def test_split_batch_for_dp_balances_tokens():
    L = 10
    lens = torch.tensor([10, 9, 2, 1, 5, 5])
    am = torch.arange(L)[None] < lens[:, None]
    batch = {"input_ids": torch.arange(6)[:, None].repeat(1, L) * am, "attention_mask": am,
             "rewards": torch.arange(6).float()}
    parts = packing.split_batch_for_dp(batch, 2)
    tokens = [int(p["attention_mask"].sum()) for p in parts]
    assert sum(tokens) == int(lens.sum()) and abs(tokens[0] - tokens[1]) <= 2
    assert sorted(torch.cat([p["rewards"] for p in parts]).tolist()) == list(range(6))
    with pytest.raises(ValueError):
        packing.split_batch_for_dp(batch, 7)


def test_pack_and_unpack_roundtrip():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    am = ids != 0
    am[2] = True
    mb = {"input_ids": ids, "attention_mask": am}
    pk = packing.pack(mb, pad_to_multiple_of=4, pad_token_id=0)
    assert pk.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0, 0]]
    assert pk.n_real == 9
    tgt = packing.next_token_targets(pk)
    assert tgt.tolist()[:9] == [6, 7, 0, 9, 0, 2, 3, 4, 0]
    vals = torch.arange(12).float()  # value at packed position p "predicts" p+1
    out = packing.unpack_shifted(vals, pk, 4)
    assert out.tolist() == [[0, 0, 1, 0], [0, 3, 0, 0], [0, 5, 6, 7]]


def test_packed_mask_is_block_diagonal_causal():
    seq = torch.tensor([[0, 0, 1, 1, 1, 2]])
    m = packing.packed_causal_mask(seq)[0, 0]
    assert m[1, 0] and not m[0, 1]  # causal inside sequence 0
    assert not m[2, 1] and m[4, 2]  # no attention across sequences
    assert m.diagonal().all()


def test_padded_mask_hides_padding_keys():
    am = torch.tensor([[1, 1, 0]]).bool()
    m = packing.padded_causal_mask(am)[0, 0]
    assert m[1, 0] and m[1, 1] and not m[1, 2]  # a real query never sees a padding key
    assert m[2, 2] and m[2, 0]  # a padded query sees itself, so its softmax is finite


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_schedules(kind):
    f = [lr_factor(s, kind=kind, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) for s in range(10)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    if kind == "constant":
        assert all(x == 1.0 for x in f[1:])
    else:
        assert all(a >= b for a, b in zip(f[1:], f[2:]))  # monotone decay after warmup
        assert lr_factor(10, kind=kind, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) == pytest.approx(0.1)
    if kind == "cosine":
        assert f[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_unknown_schedule_is_config_error():
    with pytest.raises(ConfigError, match="algo.optim.lr_scheduler"):
        lr_factor(0, kind="step", warmup_steps=0, total_steps=1)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("lens,pad", [([5, 1, 9, 3], 0), ([7], 3), ([2, 2, 2, 11, 1], 5)])
def test_varlen_attention_equals_block_diagonal_mask(lens, pad, kernel):
    """Per-sequence attention (the padding-free path) gives the same outputs and gradients as SDPA
    over the full packed block-diagonal mask, with either kernel."""
    import torch

    from areal_cli.engines import attn_kernels, packing, ulysses

    torch.manual_seed(0)
    t = sum(lens) + pad
    q, k, v = (torch.randn(1, 4, t, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sid = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [len(lens) + torch.arange(pad)])
    mask = packing.packed_causal_mask(sid[None])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    model = torch.nn.Module()
    ulysses.set_varlen(model, lens)
    out = attn_kernels.varlen_attention(q, k, v, ulysses.context(model).varlen, 0.3, attn_kernels.KERNELS[kernel])
    real = sum(lens)
    assert out.shape == ref.shape
    torch.testing.assert_close(out[:, :, :real], ref[:, :, :real])
    w = torch.randn_like(ref[:, :, :real])
    g_ref = torch.autograd.grad((ref[:, :, :real] * w).sum(), (q, k, v))
    g_out = torch.autograd.grad((out[:, :, :real] * w).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b)


def test_varlen_cost_rule_prefers_mask_for_one_long_sequence():
    from areal_cli.engines import ulysses

    assert ulysses.varlen_is_cheaper([36] * 64, 64 * 36)
    assert not ulysses.varlen_is_cheaper([2000] + [10] * 60, 2600)


def test_loss_positions_are_the_predicting_positions_of_loss_tokens():
    """Packed position of token i-1 predicts token i; only loss tokens' predictors are kept."""
    mb = {"input_ids": torch.ones(3, 5, dtype=torch.long),
          "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),
          "loss_mask": torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 1], [1, 0, 0, 0, 0]])}
    pk = packing.pack(mb)
    # row 0 starts at 0 (tokens 1, 2 -> positions 0, 1); row 1 starts at 3 (tokens 3, 4 -> 5, 6);
    # row 2 is one token: nothing predicts it.
    assert packing.loss_positions(mb, pk).tolist() == [0, 1, 5, 6]
    tgt = packing.next_token_targets(pk)
    ids = pk.input_ids[0]
    for t in packing.loss_positions(mb, pk).tolist():
        assert tgt[t] == ids[t + 1]


def _grouped(prompts: list[list[int]], sizes: list[int], comp: list[int], L: int = 40) -> dict:
    rows = [(p, c) for p, k in zip(prompts, sizes) for c in [comp[: 2 + j % 3] for j in range(k)]]
    B = len(rows)
    ids = torch.zeros(B, L, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.bool)
    lm = torch.zeros(B, L)
    for r, (p, c) in enumerate(rows):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        am[r, : len(p) + len(c)] = True
        lm[r, len(p): len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def test_prefix_bins_keep_groups_together_and_cut_oversized_ones():
    b = _grouped([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], [4, 4], [20, 21, 22, 23])
    assert packing.prefix_groups(b) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    lens, first = packing.seq_lens(b), packing.first_loss_index(b)
    assert first == [6] * 8
    # A group costs its prompt once: 6 + (2 + 3 + 4 + 2) = 17 tokens, not 4 * 6 + 11 = 35.
    assert packing.shared_cost(lens, first, [0, 1, 2, 3]) == 17
    assert packing.prefix_bins(b, 34) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert packing.prefix_bins(b, 20) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Over budget: a group is cut into chunks that each carry the prompt.
    cut = packing.prefix_bins(b, 12)
    assert sorted(r for bb in cut for r in bb) == list(range(8))
    assert all(packing.shared_cost(lens, first, bb) <= 12 for bb in cut)
    assert all(set(bb) <= {0, 1, 2, 3} or set(bb) <= {4, 5, 6, 7} for bb in cut)


def test_pack_shared_needs_a_shared_prompt():
    distinct = _grouped([[5, 6, 7], [8, 9, 10]], [1, 1], [20, 21, 22])
    assert packing.pack_shared(distinct) is None
    shared = _grouped([[5, 6, 7]], [2], [20, 21, 22])
    sp = packing.pack_shared(shared)
    assert sp.input_ids.tolist() == [[5, 6, 7, 20, 21, 20, 21, 22]]
    assert sp.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    assert sp.seg_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    # Both rows' first completion token is read at the prompt's last position (index 2).
    assert sp.keep[sp.map].tolist() == [2, 3, 2, 5, 6]
    assert sp.targets.tolist() == [20, 21, 20, 21, 22]
