"""Ulysses sequence parallelism for HF decoder models (Qwen2, Llama and their relatives).

The packed sequence is cut into ``cp`` contiguous slices, one per rank of the context-parallel
group. Everything outside attention is token-local, so it runs on the slice unchanged (rotary
embeddings use the slice's own ``position_ids``). Around attention, an all-to-all turns
"all heads, my tokens" into "my heads, all tokens", attention runs over the full sequence with the
full block-diagonal mask, and a second all-to-all turns it back.

The attention function is registered in transformers' ``AttentionInterface``, one name per
``engine.attn_impl`` (:data:`ATTN_NAMES`), so no model code is patched. It wraps the chosen kernel
(:mod:`areal_cli.engines.attn_kernels`: sdpa, eager or flash-attn) between the two all-to-alls; with a group
of size 1 it is that kernel alone, which makes sp=1 and sp>1 runs numerically comparable.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from areal_cli.engines import attn_impl, attn_kernels
from areal_cli.utils import collectives

# The name each ``engine.attn_impl`` is registered under in transformers' AttentionInterface. None holds
# "flash": transformers switches its own flash-attn handling (masks, kwargs) on names that do.
ATTN_NAMES = {attn_impl.SDPA: "areal_ulysses_sdpa", attn_impl.EAGER: "areal_ulysses_eager",
              attn_impl.FLASH: "areal_ulysses_fa2"}
ATTN_NAME = ATTN_NAMES[attn_impl.SDPA]

# The attribute every module of a model carries its :class:`AttnContext` under (the attention function is
# handed the attention module, not the model or the engine).
CTX_ATTR = "_areal_attn_ctx"


@dataclass
class AttnContext:
    """What the attention function needs beyond its arguments, per model (so per engine: an actor, its
    reference and a critic in one process each have their own, whatever their layouts): the Ulysses
    group (None: no sequence parallelism), the packed row's per-sequence layout of the next forward, and
    the flash-attn segments read off the last mask."""

    group: Any = None
    varlen: dict | None = None
    flash_mask: tuple | None = None


def context(model: "torch.nn.Module") -> AttnContext:
    """``model``'s attention context, created on first use and bound to every module it holds. Bound again
    on each call (a dict lookup per module): modules added since (pipeline stages) or copied with the
    model then point at the same object."""
    ctx = model.__dict__.get(CTX_ATTR)
    if ctx is None:
        ctx = AttnContext()
    for m in model.modules():
        if m.__dict__.get(CTX_ATTR) is not ctx:
            m.__dict__[CTX_ATTR] = ctx  # past nn.Module.__setattr__: a plain attribute, not a submodule
    return ctx


def set_ulysses_group(model: "torch.nn.Module", group: "dist.ProcessGroup | None") -> None:
    context(model).group = group


def set_varlen(model: "torch.nn.Module", lens: "list[int] | None", seg_ids: "torch.Tensor | None" = None,
               device: "torch.device | str | None" = None) -> None:
    """Lengths of the sequences packed (in order, from position 0) into ``model``'s next forward's single
    row.

    With lengths set and no explicit mask, attention runs per sequence (:func:`attn_kernels.varlen_attention`)
    instead of over the full ``T x T`` block-diagonal mask. ``seg_ids`` ``[T]`` (shared-prefix
    packing): within a sequence, a token sees the causal past of segment 0 and of its own segment.
    The layout (and the shared-prefix mask) is built here, once per forward, on ``device``: the one the
    model runs on, so that no layer copies it there.
    """
    ctx = context(model)
    ctx.flash_mask = None
    ctx.varlen = None if lens is None else attn_kernels.varlen_index(tuple(int(n) for n in lens), device, seg_ids)


def varlen_is_cheaper(lens: "list[int]", total: int) -> bool:
    """Per-sequence attention on the padded ``[n, Lmax]`` layout costs ``n*Lmax^2`` score entries, the
    block-diagonal mask ``T^2``; one very long sequence among many short ones favours the mask."""
    return bool(lens) and len(lens) * max(lens) ** 2 < total * total


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


def _kernel_out(ctx: AttnContext | None, impl: str, query, key, value, mask, dropout: float, scaling):
    """``[B, H, L, D]`` attention output of the full sequence by ``impl``'s kernel, from the engine's mask
    or, without one, the per-forward layout of :func:`set_varlen` (``ctx``: the model's context; None for
    a model no engine set one on)."""
    idx = ctx.varlen if ctx is not None else None
    if impl == attn_impl.FLASH:
        if mask is None and idx is not None:
            if "mask" in idx:
                raise ValueError(f"{attn_impl.FLASH} cannot take the shared-prefix mask (the engine turns "
                                 "shared-prefix packing off under it)")
            return attn_kernels.flash_varlen(query, key, value, idx["cu"], idx["lmax"], idx["n_real"], scaling,
                                             dropout)
        if mask is None:
            b, length = query.shape[0], query.shape[2]
            cu = torch.arange(0, (b + 1) * length, length, dtype=torch.int32, device=query.device)
            return attn_kernels.flash_varlen(query, key, value, cu, length, b * length, scaling, dropout)
        cached = ctx.flash_mask if ctx is not None else None
        if cached is None or cached[0] is not mask:  # the same mask reaches every layer: read it once
            cached = (mask, *attn_kernels.mask_segments(mask))
            if ctx is not None:
                ctx.flash_mask = cached
        return attn_kernels.flash_varlen(query, key, value, cached[1], cached[2], mask.shape[0] * mask.shape[-1],
                                         scaling, dropout)
    kernel = attn_kernels.KERNELS[impl]
    if mask is None and idx is not None and dropout == 0.0:
        return attn_kernels.varlen_attention(query, key, value, idx, scaling, kernel,
                                             causal_mask=impl == attn_impl.EAGER)
    return kernel(query, key, value, mask, mask is None, scaling, dropout)


def ulysses_attention(impl: str, module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs):
    """HF attention function running ``impl``'s kernel: ``query`` ``[B, H, L_local, D]`` → output
    ``[B, L_local, H, D]``.

    ``attention_mask`` is the boolean mask of the *full* sequence (True = attend), as built by the
    engine; GQA is handled by repeating kv heads when they do not split evenly over the group (flash-attn
    takes the grouped heads as they are otherwise).
    """
    ctx = module.__dict__.get(CTX_ATTR) if module is not None else None
    group = ctx.group if ctx is not None else None
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
    if key.shape[1] != query.shape[1] and impl != attn_impl.FLASH:
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
        out = _kernel_out(ctx, impl, query, key, value, mask, dropout, scaling)
    out = out.to(dtype)
    if world > 1:
        out = all_to_all(out, 2, 1, group)
    return out.transpose(1, 2).contiguous(), None


def _named(impl: str):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
        return ulysses_attention(impl, module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    attention.__name__ = attention.__qualname__ = f"ulysses_{impl}"
    return attention


ATTN_FUNCTIONS = {impl: _named(impl) for impl in ATTN_NAMES}
ulysses_sdpa = ATTN_FUNCTIONS[attn_impl.SDPA]


def register(impl: str, device: "torch.device | str") -> str:
    """Register the Ulysses-aware attention function running ``impl``'s kernel with transformers
    (idempotent) and return its name; a typed refusal when ``impl`` cannot run on ``device``."""
    from transformers import AttentionInterface

    attn_impl.check(impl, "hf", torch.device(device).type)
    if impl == attn_impl.FLASH:
        try:
            attn_kernels._flash_fn()
        except ImportError as e:  # installed, but built for another torch or CUDA
            from areal_cli.errors import ConfigError

            raise ConfigError(attn_impl.PATH, f"flash_attn is installed but does not import ({e})",
                              f"reinstall flash-attn for this torch and CUDA, or set {attn_impl.PATH}="
                              f"{attn_impl.SDPA}") from None
    AttentionInterface.register(ATTN_NAMES[impl], ATTN_FUNCTIONS[impl])
    return ATTN_NAMES[impl]
