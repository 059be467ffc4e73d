"""Keep-Sampling-Mask: logprobs under the top-k/top-p truncated distribution the rollout sampled from.

With top-k or top-p the behaviour policy is the truncated, renormalised distribution, not the full
softmax, so an importance ratio of full-softmax logprobs is biased. The ``hf`` server records, per
generated token, the kept set as one float: ``cutoff``, the smallest kept value of ``logits / T``
(its sampler keeps every token at or above it, ties included; ``-inf``: nothing was cut). The
trainer rebuilds the set from its own ``logits / T`` and renormalises over it.

Why a threshold, not a list of token ids: it is one float per token for any ``k`` and any nucleus
(top-p sets can be thousands of tokens), it travels in the batch as an ordinary ``[B, L]`` tensor
through packing and Ulysses slicing, and a vocab shard applies it to its own columns without
knowing the others. The sampled token is always kept: the trainer's logits differ from the
server's by rounding, and a token the sampler drew must never get probability zero.

Batch key: ``sampling_cutoff`` (float ``[B, L]``, aligned like ``logprobs``; ``-inf`` where nothing
is cut, on prompt tokens and on padding). Pure tensor functions; the vocab-parallel reduction lives
in ``engines/archon/vocab_parallel.py``.
"""

from __future__ import annotations

import torch

KEY = "sampling_cutoff"


def keep_mask(z: torch.Tensor, targets: torch.Tensor, cutoffs: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``[..., V_local]`` bool: column ``v`` (global id ``start + v``) is in the kept set of its row.

    ``z`` is ``logits / T`` of this vocab slice, ``targets`` ``[...]`` global token ids, ``cutoffs``
    ``[...]`` the recorded thresholds in the same units."""
    cols = torch.arange(z.shape[-1], device=z.device) + start
    keep = z >= cutoffs.to(z.device, z.dtype).unsqueeze(-1)
    return keep | (cols == targets.unsqueeze(-1))


def masked_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                            cutoffs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log p(target) and entropy of ``softmax(logits / T)`` restricted to the kept set, in fp32.

    Masked columns get exactly zero probability and zero gradient (``masked_fill`` before the
    product keeps ``0 * -inf`` out of both the forward and the backward)."""
    z = logits.float() / temperature
    keep = keep_mask(z, targets, cutoffs)
    logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp0 = logp.masked_fill(~keep, 0.0)
    return lp, -(logp0.exp() * keep * logp0).sum(-1)


def next_token_values(values: torch.Tensor, lengths: list[int], total: int) -> torch.Tensor:
    """``[total]`` per packed position: the value of the *next* token of the same row (``-inf`` at a
    row's last token and on padding), the layout of ``engines/packing.py:next_token_targets``."""
    out = torch.full((total,), float("-inf"), dtype=torch.float32)
    start = 0
    for r, n in enumerate(lengths):
        if n > 1:
            out[start:start + n - 1] = values[r, 1:n].float()
        start += n
    return out


def shifted_padded(values: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: position ``i`` gets the value of token ``i + 1`` (the padded path's targets)."""
    v = values.float()
    return torch.cat([v[:, 1:], torch.full_like(v[:, :1], float("-inf"))], dim=1)
