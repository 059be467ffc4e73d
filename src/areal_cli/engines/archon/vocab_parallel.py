"""Vocab-parallel output: ``lm_head`` sharded on the vocabulary, logprobs and entropy without ever
holding the full ``[T, V]`` logits on one rank.

Each tensor-parallel rank holds the logits of its contiguous vocab slice ``[..., V/t]``. With
``z = logits / T``:

- ``m = max_v z`` (all-reduce MAX, no gradient: the result does not depend on the shift);
- ``s = Σ_v exp(z - m)`` (all-reduce SUM), ``log Z = m + log s``;
- ``log p(y) = z_y - log Z`` where ``z_y`` comes from the one rank owning ``y`` (all-reduce SUM of
  each rank's masked pick);
- ``H = log s - Σ_v exp(z - m)(z - m) / s`` (all-reduce SUM of the numerator).

Every rank then holds the same ``[..., ]`` results and computes the same loss from them. The sums
are differentiable all-reduces whose backward is the identity (Megatron's "reduce from the
tensor-parallel region"): the loss is replicated, so each rank's upstream gradient already *is* the
gradient of the one true loss, and each rank passes it to its own vocab slice. Summing the incoming
gradients (what ``torch.distributed.nn.all_reduce`` does) would count the loss ``t`` times.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from areal_cli.engines import sampling_mask, token_logprobs
from areal_cli.utils import collectives


def lm_head_style():
    """``ColwiseParallel`` for ``lm_head``: full hidden states in (the final norm gathers them), plain
    local logits of this rank's vocab slice out (``Shard(-1)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        collectives.all_reduce(out, op=collectives.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def vocab_range(vocab_size: int, group: Any) -> tuple[int, int]:
    """``[start, end)`` of this rank's vocab slice, as DTensor's ``Shard`` cuts it (``torch.chunk``:
    ``ceil(V/t)`` per rank, the last ones shorter or empty)."""
    world = _group_size(group)
    if world == 1:
        return 0, vocab_size
    rank = dist.get_rank(group)
    chunk = -(-vocab_size // world)
    start = min(rank * chunk, vocab_size)
    return start, min(start + chunk, vocab_size)


def logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                     group: Any = None, vocab_size: int | None = None,
                     cutoffs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` and entropy of ``softmax(logits / temperature)``, in fp32.

    ``logits`` ``[..., V_local]`` is this rank's vocab slice (the whole vocabulary when ``group`` is
    ``None`` or has one rank); ``targets`` ``[...]`` holds global token ids. ``vocab_size`` is the full
    vocabulary (default ``V_local × t``). Returns two ``[...]`` tensors, equal on every rank of the
    group, differentiable with respect to ``logits``.

    ``cutoffs`` ``[...]`` (Keep-Sampling-Mask, engines/sampling_mask.py): the distribution is restricted
    to each row's kept set. Each rank masks its own columns (a threshold needs no other shard); the
    max and the sums then run over kept columns only, so the reductions are the same three all-reduces.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    world = _group_size(group)
    if world == 1:
        return token_logprobs.logprobs_entropy(logits, targets, temperature, cutoffs)
    z = logits.float() / temperature
    vocab_size = vocab_size if vocab_size is not None else z.shape[-1] * world
    start, end = vocab_range(vocab_size, group)
    if z.shape[-1] != end - start:
        raise ValueError(f"local logits have {z.shape[-1]} columns but this rank's slice of a "
                         f"{vocab_size}-token vocabulary is [{start}, {end})")
    keep = None if cutoffs is None else sampling_mask.keep_mask(z, targets, cutoffs, start)
    with torch.no_grad():
        if z.shape[-1]:
            m = (z if keep is None else z.masked_fill(~keep, -float("inf"))).max(dim=-1, keepdim=True).values
        else:  # an empty slice (more ranks than ceil-sized chunks) contributes nothing
            m = z.new_full((*z.shape[:-1], 1), -float("inf"))
        collectives.all_reduce(m, op=collectives.ReduceOp.MAX, group=group)
    zc = z - m
    if keep is None:
        e = zc.exp()
    else:  # masked columns: zero mass and zero gradient (no exp(-inf) * -inf anywhere)
        zc = zc.masked_fill(~keep, 0.0)
        e = zc.exp() * keep
    s = _AllReduceSum.apply(e.sum(-1), group)
    num = _AllReduceSum.apply((e * zc).sum(-1), group)
    own = (targets >= start) & (targets < end)
    local_t = (targets - start).clamp(0, max(end - start - 1, 0))
    picked = zc.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) if z.shape[-1] else zc.new_zeros(targets.shape)
    zt = _AllReduceSum.apply(picked * own, group)
    log_s = s.log()
    return zt - log_s, log_s - num / s


def full_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same on the whole vocabulary (the one-rank reference)."""
    return logprobs_entropy(logits, targets, temperature, group=None)
