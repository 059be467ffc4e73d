"""The chunked fused logprob/entropy equals the plain formula, forward and gradients, with and without
Keep-Sampling-Mask cutoffs, across chunk boundaries."""

import pytest
import torch

from areal_cli.engines import token_logprobs
from areal_cli.engines.sampling_mask import masked_logprobs_entropy


def plain(logits, targets, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def cutoffs_for(logits, temperature, k, gen):
    """A top-k cutoff per position (the k-th largest ``logits / T``), ``-inf`` at some positions."""
    cut = (logits.double() / temperature).topk(k, dim=-1).values[..., -1]
    off = torch.rand(cut.shape, generator=gen) < 0.3
    return cut.masked_fill(off, float("-inf"))


@pytest.mark.parametrize("chunk_elems", [7, 64, 1 << 22])  # 1-row chunks, a ragged last chunk, one chunk
@pytest.mark.parametrize("masked", [False, True])
def test_equals_the_plain_formula_values_and_gradients(monkeypatch, chunk_elems, masked):
    monkeypatch.setattr(token_logprobs, "CHUNK_ELEMS", chunk_elems)
    gen = torch.Generator().manual_seed(0)
    temperature = 0.7
    logits = (3 * torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    cut = cutoffs_for(logits.detach(), temperature, 4, gen) if masked else None
    g_lp, g_ent = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(3, 5, generator=gen,
                                                                                    dtype=torch.float64)

    lp, ent = token_logprobs.logprobs_entropy(logits, targets, temperature, cut)
    (lp * g_lp + ent * g_ent).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    if masked:
        lp_r, ent_r = masked_logprobs_entropy(logits, targets, temperature, cut)
    else:
        lp_r, ent_r = plain(logits, targets, temperature)
    (lp_r * g_lp + ent_r * g_ent).sum().backward()

    assert lp.dtype == torch.float32 and ent.shape == (3, 5)
    # the fused function works in fp32 (as the plain formula's ``.float()``); the reference in fp64
    torch.testing.assert_close(lp.double(), lp_r.double(), atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r.double(), atol=2e-5, rtol=0)
    torch.testing.assert_close(got, logits.grad, atol=2e-5, rtol=0)
    if masked:  # masked columns get no gradient, the sampled token always some
        z = logits.detach() / temperature
        dropped = (z < cut.unsqueeze(-1)) & (torch.arange(11) != targets.unsqueeze(-1))
        assert dropped.any() and (got[dropped] == 0).all()


def test_bf16_logits_give_fp32_results_and_a_bf16_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, 50, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (4, 9), generator=gen)
    lp, ent = token_logprobs.logprobs_entropy(logits, targets)
    lp.sum().backward()
    lp_r, ent_r = plain(logits.detach().float(), targets, 1.0)
    assert lp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_r, atol=1e-5, rtol=0)


def test_keeps_one_copy_of_the_logits_for_the_backward():
    """What autograd holds between forward and backward: the logits and one float per token, not
    ``logp`` and ``exp(logp)`` as the plain formula does."""
    logits = torch.randn(64, 1000, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs.logprobs_entropy(logits, targets)
    assert sum(n for n in saved if n >= 1000) == logits.numel()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain(logits.float(), targets, 1.0)
    assert sum(n for n in saved if n >= 1000) >= 2 * logits.numel()  # the comparison can fail


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs.logprobs_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0)
