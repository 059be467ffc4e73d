"""Vocab-parallel output: ``lm_head`` sharded on the vocabulary, logprobs and entropy without ever
holding the full ``[T, V]`` logits on one rank.

Each tensor-parallel rank holds the logits of its contiguous vocab slice ``[..., V/t]``. With
``z = logits / T``:

- ``m = max_v z`` (all-reduce MAX, no gradient: the result does not depend on the shift);
- ``s = Σ_v exp(z - m)`` (all-reduce SUM), ``log Z = m + log s``;
- ``log p(y) = z_y - log Z`` where ``z_y`` comes from the one rank owning ``y`` (all-reduce SUM of
  each rank's masked pick);
- ``H = log s - Σ_v exp(z - m)(z - m) / s`` (all-reduce SUM of the numerator).

Every rank then holds the same ``[..., ]`` results and computes the same loss from them. The loss is
replicated, so each rank's upstream gradient already *is* the gradient of the one true loss, and each
rank's backward gives its own vocab slice its share, with no collective (Megatron's "reduce from the
tensor-parallel region"); summing the incoming gradients would count the loss ``t`` times. The
computation (chunked, no vocabulary-sized temporaries) is ``engines/token_logprobs.py``'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from areal_cli.engines import token_logprobs


def lm_head_style():
    """``ColwiseParallel`` for ``lm_head``: full hidden states in (the final norm gathers them), plain
    local logits of this rank's vocab slice out (``Shard(-1)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)


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
    vocab_size = vocab_size if vocab_size is not None else logits.shape[-1] * world
    start, end = vocab_range(vocab_size, group)
    if logits.shape[-1] != end - start:
        raise ValueError(f"local logits have {logits.shape[-1]} columns but this rank's slice of a "
                         f"{vocab_size}-token vocabulary is [{start}, {end})")
    return token_logprobs.logprobs_entropy(logits, targets, temperature, cutoffs, group=group, start=start)


def full_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same on the whole vocabulary (the one-rank reference)."""
    return logprobs_entropy(logits, targets, temperature, group=None)
