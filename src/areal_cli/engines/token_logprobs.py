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

A vocabulary split over a tensor-parallel ``group`` (each rank holding the logits of its columns
``[start, start + V_local)``) takes the same path: per token, the row max (all-reduce MAX), then
``sum exp(z - m)``, ``sum exp(z - m) (z - m)`` and the owner's ``z[t] - m`` (one all-reduce SUM of the
three), exactly the reductions ``engines/archon/vocab_parallel.py`` describes. The backward needs no
collective: ``lse`` and ``H`` are saved, and each rank's gradient is its own columns' share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from areal_cli.utils import collectives

CHUNK_ELEMS = 1 << 22  # 16 MB of fp32 logits per chunk: a few such temporaries at a time


def logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     cutoffs: torch.Tensor | None = None, *, group: Any = None,
                     start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[..., V]`` (any float dtype; this rank's columns ``[start, start + V)`` when ``group``
    splits the vocabulary), ``targets`` ``[...]`` global token ids, ``cutoffs`` ``[...]`` or ``None``.
    Returns fp32 ``(logprobs, entropy)`` of shape ``[...]``, equal on every rank of ``group``,
    differentiable w.r.t. ``logits``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _LogprobEntropy.apply(logits, targets, cutoffs, float(temperature), group, start)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMS // max(vocab, 1))


def _scaled(logits: torch.Tensor, targets: torch.Tensor, cutoffs: torch.Tensor | None, temperature: float,
            start: int):
    """``z = logits / T`` in fp32 with masked columns at ``-inf``, and the kept set (``None``: all)."""
    z = logits.float() / temperature
    if cutoffs is None:
        return z, None
    cols = torch.arange(z.shape[-1], device=z.device) + start
    keep = (z >= cutoffs.to(z.device, z.dtype).unsqueeze(-1)) | (cols == targets.unsqueeze(-1))
    return z.masked_fill(~keep, float("-inf")), keep


def _row_max(z: torch.Tensor) -> torch.Tensor:
    return z.amax(-1) if z.shape[-1] else z.new_full(z.shape[:-1], float("-inf"))


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, cutoffs, temperature, group, start):
        n, vocab = targets.numel(), logits.shape[-1]
        flat, tgt = logits.reshape(n, vocab), targets.reshape(n).to(logits.device)
        cut = None if cutoffs is None else cutoffs.reshape(n).to(logits.device)
        own = (tgt >= start) & (tgt < start + vocab)
        local_t = (tgt - start).clamp(0, max(vocab - 1, 0))
        step = _chunk_rows(vocab)
        chunks = [(s, min(s + step, n)) for s in range(0, n, step)]

        def scaled(s, e):
            return _scaled(flat[s:e], tgt[s:e], None if cut is None else cut[s:e], temperature, start)

        m = torch.empty(n, dtype=torch.float32, device=logits.device)
        if group is not None:  # the global row max first; one pass suffices when the row is all here
            for s, e in chunks:
                m[s:e] = _row_max(scaled(s, e)[0])
            collectives.all_reduce(m, op=collectives.ReduceOp.MAX, group=group)
        sums = torch.zeros(3, n, dtype=torch.float32, device=logits.device)  # sum e, sum e * zc, zc[t]
        for s, e in chunks:
            z, keep = scaled(s, e)
            if group is None:
                m[s:e] = _row_max(z)
            zc = z - m[s:e, None]
            ez = zc.exp()
            zc0 = zc if keep is None else zc.masked_fill(~keep, 0.0)  # masked: 0, not 0 * -inf
            sums[0, s:e], sums[1, s:e] = ez.sum(-1), (ez * zc0).sum(-1)
            if vocab:
                picked = zc0.gather(-1, local_t[s:e, None]).squeeze(-1)
                sums[2, s:e] = torch.where(own[s:e], picked, 0.0)
        if group is not None:
            collectives.all_reduce(sums, op=collectives.ReduceOp.SUM, group=group)
        log_s = sums[0].log()
        lp, ent = sums[2] - log_s, log_s - sums[1] / sums[0]
        ctx.save_for_backward(logits, tgt, cut, m + log_s, ent, own, local_t)
        ctx.temperature, ctx.start = temperature, start
        return lp.view(targets.shape), ent.view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        logits, tgt, cut, lse, ent, own, local_t = ctx.saved_tensors
        temperature = ctx.temperature
        n, vocab = tgt.numel(), logits.shape[-1]
        flat = logits.reshape(n, vocab)
        g_lp, g_ent = g_lp.reshape(n).float(), g_ent.reshape(n).float()
        grad = torch.empty_like(flat)
        step = _chunk_rows(vocab)
        for s in range(0, n if vocab else 0, step):
            e = min(s + step, n)
            z, keep = _scaled(flat[s:e], tgt[s:e], None if cut is None else cut[s:e], temperature, ctx.start)
            logp = z - lse[s:e, None]
            p = logp.exp()
            logp0 = logp if keep is None else logp.masked_fill(~keep, 0.0)
            gz = -p * (g_lp[s:e, None] + g_ent[s:e, None] * (logp0 + ent[s:e, None]))
            gz.scatter_add_(-1, local_t[s:e, None], torch.where(own[s:e], g_lp[s:e], 0.0)[:, None])
            grad[s:e] = gz / temperature
        return grad.view(logits.shape), None, None, None, None, None
