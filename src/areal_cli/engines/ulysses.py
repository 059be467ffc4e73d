"""Ulysses sequence parallelism for HF decoder models (Qwen2, Llama and their relatives).

The packed sequence is cut into ``cp`` contiguous slices, one per rank of the context-parallel
group. Everything outside attention is token-local, so it runs on the slice unchanged (rotary
embeddings use the slice's own ``position_ids``). Around attention, an all-to-all turns
"all heads, my tokens" into "my heads, all tokens", attention runs over the full sequence with the
full block-diagonal mask, and a second all-to-all turns it back.

The attention function is registered in transformers' ``AttentionInterface`` under
:data:`ATTN_NAME`, so no model code is patched; with a group of size 1 it is plain SDPA with an
explicit mask, which makes sp=1 and sp>1 runs numerically comparable.
"""

from __future__ import annotations

import contextlib

from typing import Any

import torch
import torch.distributed as dist

from areal_cli.utils import collectives

ATTN_NAME = "areal_ulysses_sdpa"

_STATE: dict[str, Any] = {"group": None, "mask": None, "varlen": None}


def set_ulysses_group(group: "dist.ProcessGroup | None") -> None:
    _STATE["group"] = group


def set_varlen(lens: "list[int] | None", seg_ids: "torch.Tensor | None" = None) -> None:
    """Lengths of the sequences packed (in order, from position 0) into the next forward's single row.

    With lengths set and no explicit mask, attention runs per sequence (:func:`varlen_sdpa`)
    instead of over the full ``T x T`` block-diagonal mask. ``seg_ids`` ``[T]`` (shared-prefix
    packing): within a sequence, a token sees the causal past of segment 0 and of its own segment.
    """
    if lens is None:
        _STATE["varlen"] = None
        return
    idx = _varlen_index(tuple(int(n) for n in lens))
    if seg_ids is not None:
        seg = seg_ids[idx["gather"]]  # [n, Lmax]; padding columns repeat the last token's segment
        lmax = seg.shape[1]
        causal = torch.ones(lmax, lmax, dtype=torch.bool).tril()
        same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
        idx["mask"] = (causal[None] & same)[:, None]
    _STATE["varlen"] = idx


def varlen_is_cheaper(lens: "list[int]", total: int) -> bool:
    """Per-sequence attention on the padded ``[n, Lmax]`` layout costs ``n*Lmax^2`` score entries, the
    block-diagonal mask ``T^2``; one very long sequence among many short ones favours the mask."""
    return bool(lens) and len(lens) * max(lens) ** 2 < total * total


def _varlen_index(lens: tuple[int, ...]) -> dict[str, Any]:
    n, lmax = len(lens), max(lens)
    starts = torch.tensor([0, *lens[:-1]], dtype=torch.long).cumsum(0)
    j = torch.arange(lmax)
    length = torch.tensor(lens, dtype=torch.long)
    # Row r, column j reads packed token starts[r] + min(j, len_r - 1): padding columns repeat the
    # row's last token; under the causal mask only later padding queries ever see them.
    gather = starts[:, None] + torch.minimum(j[None, :], length[:, None] - 1)
    valid = (j[None, :] < length[:, None]).reshape(-1).nonzero().squeeze(1)
    return {"gather": gather, "valid": valid, "n_real": sum(lens), "shape": (n, lmax)}


def varlen_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, idx: dict[str, Any],
                scaling: float | None) -> torch.Tensor:
    """Causal attention of each packed sequence on its own. ``[1, H, T, D]`` in, ``[1, H, T, D]`` out
    (positions past the packed sequences get zeros)."""
    n, lmax = idx["shape"]
    g = idx["gather"].to(query.device)

    def pad(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [n, H, Lmax, D]
        return x[0][:, g].transpose(0, 1)

    mask = idx.get("mask")
    if mask is not None:
        mask = mask.to(query.device)
    out = torch.nn.functional.scaled_dot_product_attention(pad(query), pad(key), pad(value), attn_mask=mask,
                                                           is_causal=mask is None, scale=scaling)
    h, d = out.shape[1], out.shape[3]
    flat = out.transpose(0, 1).reshape(h, n * lmax, d).index_select(1, idx["valid"].to(query.device))
    t = query.shape[2]
    if t > idx["n_real"]:
        flat = torch.cat([flat, flat.new_zeros(h, t - idx["n_real"], d)], dim=1)
    return flat[None]


def get_ulysses_group() -> "dist.ProcessGroup | None":
    return _STATE["group"]


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    inp = torch.stack(x.chunk(world, dim=scatter_dim), dim=0).contiguous()
    out = torch.empty_like(inp)
    collectives.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Differentiable all-to-all: split ``scatter_dim`` over ranks, concatenate on ``gather_dim``."""
    return _SeqAllToAll.apply(x, scatter_dim, gather_dim, group)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0. Backward keeps only this rank's slice of the gradient: every rank
    computes the same loss from the gathered tensor, so the slices' gradients add up (through the
    data-parallel gradient sum) to exactly one copy of the true gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        collectives.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        world = dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=0)[rank].contiguous(), None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's slice along dim 0 (identity for a group of size 1)."""
    if _group_size(group) == 1:
        return x
    return _GatherSeq.apply(x, group)


def slice_for_rank(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (length must divide evenly)."""
    world = _group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=dim)[dist.get_rank(group)]


def ulysses_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: float | None = None, **kwargs):
    """HF attention function: ``query`` ``[B, H, L_local, D]`` → output ``[B, L_local, H, D]``.

    ``attention_mask`` is the boolean mask of the *full* sequence (True = attend), as built by the
    engine; GQA is handled by repeating kv heads when they do not split evenly over the group.
    """
    group = _STATE["group"]
    world = _group_size(group)
    n_heads, n_kv = query.shape[1], key.shape[1]
    if world > 1:
        if n_heads % world:
            raise ValueError(f"Ulysses needs num_attention_heads ({n_heads}) divisible by cp ({world})")
        if n_kv % world:
            rep = n_heads // n_kv
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        query = all_to_all(query, 1, 2, group)
        key = all_to_all(key, 1, 2, group)
        value = all_to_all(value, 1, 2, group)
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask >= 0  # additive float mask: 0 keeps, -inf hides
    dtype = query.dtype
    # Under CPU autocast (engine.dtype=bfloat16 on one rank) the projections run in bf16, but the CPU
    # flash-attention backward is 2.5x slower in bf16 than in fp32 at these shapes: attend in fp32.
    fp32_attn = query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", enabled=False) if fp32_attn else contextlib.nullcontext():
        if fp32_attn:
            query, key, value = query.float(), key.float(), value.float()
        if mask is None and _STATE["varlen"] is not None and dropout == 0.0:
            out = varlen_sdpa(query, key, value, _STATE["varlen"], scaling)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None)
    out = out.to(dtype)
    if world > 1:
        out = all_to_all(out, 2, 1, group)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`ulysses_sdpa` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_sdpa)
    return ATTN_NAME
