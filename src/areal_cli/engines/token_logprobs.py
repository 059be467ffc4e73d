"""Per-token log p(target) and entropy of ``softmax(logits / T)``, without vocabulary-sized temporaries.

Why: the plain formula (``log_softmax``, ``gather``, ``-(exp(logp) * logp).sum(-1)``) keeps ``logp`` and
``exp(logp)`` for the backward and makes three more ``[tokens, V]`` fp32 tensors on the way, five
copies of the logits at its peak. At a 152k vocabulary that is 0.6 GB per 1,000 tokens each: on an
8k-token micro-batch, 25 GB of a GPU's memory for one loss, and the largest transient of a training
step on this CPU's 0.5B benchmark (``benchmarks/engine_memory.py``). :func:`logprobs_entropy` keeps
only the logits (which the step holds anyway) and one float per token, and works ``CHUNK_ELEMS``
logits at a time in the forward and the backward, which recomputes the softmax chunk by chunk.

The math is the plain formula's, in fp32 whatever the logits' dtype, with Keep-Sampling-Mask's kept
set (``cutoffs``, ``engines/sampling_mask.py``) applied as the masked formula does: masked columns get
zero probability and zero gradient. With ``p = softmax(z)``, ``z = logits / T`` (masked: ``-inf``):

- ``lp = log p[t]`` and ``H = -sum(p * log p)``, with ``log p = z - lse(z)``;
- ``d lp / d z = onehot(t) - p`` and ``d H / d z = -p * (log p + H)``.

A vocabulary split over a TP group goes through ``engines/archon/vocab_parallel.py`` instead.
"""

from __future__ import annotations

import torch

CHUNK_ELEMS = 1 << 22  # 16 MB of fp32 logits per chunk: a few such temporaries at a time


def logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     cutoffs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[..., V]`` (any float dtype), ``targets`` ``[...]`` token ids, ``cutoffs`` ``[...]`` or
    ``None``. Returns fp32 ``(logprobs, entropy)`` of shape ``[...]``, differentiable w.r.t. ``logits``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _LogprobEntropy.apply(logits, targets, cutoffs, float(temperature))


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMS // max(vocab, 1))


def _scaled(logits: torch.Tensor, targets: torch.Tensor, cutoffs: torch.Tensor | None, temperature: float):
    """``z = logits / T`` in fp32 with masked columns at ``-inf``, and the kept set (``None``: all)."""
    z = logits.float() / temperature
    if cutoffs is None:
        return z, None
    cols = torch.arange(z.shape[-1], device=z.device)
    keep = (z >= cutoffs.to(z.device, z.dtype).unsqueeze(-1)) | (cols == targets.unsqueeze(-1))
    return z.masked_fill(~keep, float("-inf")), keep


def _logp(z: torch.Tensor, keep: torch.Tensor | None, lse: torch.Tensor):
    """``log p`` (0 on masked columns, so ``p * log p`` is 0 there, not ``0 * -inf``) and ``p``.

    Sums run over ``log p``, not ``z``: ``lse - sum(p * z)`` loses digits to cancellation in fp32."""
    logp = z - lse[:, None]
    p = logp.exp()
    return (logp if keep is None else logp.masked_fill(~keep, 0.0)), p


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, cutoffs, temperature):
        vocab = logits.shape[-1]
        flat, tgt = logits.reshape(-1, vocab), targets.reshape(-1).to(logits.device)
        cut = None if cutoffs is None else cutoffs.reshape(-1).to(logits.device)
        n = flat.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        step = _chunk_rows(vocab)
        for s in range(0, n, step):
            e = min(s + step, n)
            z, keep = _scaled(flat[s:e], tgt[s:e], None if cut is None else cut[s:e], temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logp, p = _logp(z, keep, lse[s:e])
            lp[s:e] = logp.gather(-1, tgt[s:e, None]).squeeze(-1)
            ent[s:e] = -(p * logp).sum(-1)
        ctx.save_for_backward(logits, tgt, cut, lse, ent)
        ctx.temperature = temperature
        return lp.view(targets.shape), ent.view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        logits, tgt, cut, lse, ent = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        g_lp, g_ent = g_lp.reshape(-1).float(), g_ent.reshape(-1).float()
        grad = torch.empty_like(flat)
        n, step = flat.shape[0], _chunk_rows(vocab)
        for s in range(0, n, step):
            e = min(s + step, n)
            z, keep = _scaled(flat[s:e], tgt[s:e], None if cut is None else cut[s:e], temperature)
            logp, p = _logp(z, keep, lse[s:e])
            gz = -p * (g_lp[s:e, None] + g_ent[s:e, None] * (logp + ent[s:e, None]))
            gz.scatter_add_(-1, tgt[s:e, None], g_lp[s:e, None])
            grad[s:e] = gz / temperature
        return grad.view(logits.shape), None, None, None
