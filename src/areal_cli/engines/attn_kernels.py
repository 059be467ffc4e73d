"""The attention kernels behind ``engine.attn_impl`` for the HF-module engines (fsdp, archon, deepspeed).

Every kernel takes ``[B, H, L, D]`` query/key/value (key/value heads already matching the query's, except
for flash-attn, which takes grouped kv heads as they are) and returns ``[B, H, L, D]``:

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (torch picks its flash, memory-efficient or
  math backend);
- ``eager``: the explicit matmul, softmax in fp32, matmul of HF's ``eager_attention_forward`` (computed here,
  since the mask is the engine's boolean one);
- ``flash_attention_2``: ``flash_attn_varlen_func`` over the packed sequences. It takes no mask: sequence
  boundaries come from the per-sequence lengths (padding-free micro-batches) or are read off the engine's
  causal masks (see :func:`mask_segments`). It computes in bf16/fp16 only, so fp32 inputs are cast to bf16
  around the kernel.

The per-forward layout (:func:`varlen_index`: gather index, masks, ``cu_seqlens``) is built once on the
device the model runs on, and every layer reads it from there.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Kernel = Callable[..., torch.Tensor]  # (q, k, v, mask, causal, scale, dropout) -> out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                            is_causal=causal and mask is None, scale=scale)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """HF's eager attention; ``mask`` is boolean (True = attend)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None and causal:  # only reached without an engine-built layout (a direct model call)
        n_q, n_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    if mask is not None:
        # the smallest finite value, as HF's additive masks: a row that hides everything stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # softmax in fp32 at least (HF's choice for bf16/fp16), in fp64 for fp64 inputs
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    if dropout > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, v)


KERNELS: dict[str, Kernel] = {"sdpa": sdpa, "eager": eager}


def varlen_index(lens: tuple[int, ...], device: torch.device | str | None = None,
                 seg_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """The layout of one forward's packed row of sequences ``lens`` (in order, from position 0), on ``device``.

    ``gather`` ``[n, Lmax]``: row r, column j reads packed token ``starts[r] + min(j, len_r - 1)`` (padding
    columns repeat the row's last token; under the causal mask only later padding queries ever see them).
    ``seg_ids`` ``[T]`` (shared-prefix packing): ``mask`` ``[n, 1, Lmax, Lmax]`` lets a token see the causal
    past of segment 0 and of its own segment. ``cu``/``lmax``: flash-attn's ``cu_seqlens``/``max_seqlen``.
    """
    n, lmax = len(lens), max(lens)
    # The index tensors are small and built on the host (no device sync for their data-dependent sizes),
    # then copied over once; the masks, quadratic in the length, are built on the device itself.
    length = torch.tensor(lens, dtype=torch.long)
    starts = torch.cumsum(length, 0) - length
    j = torch.arange(lmax)
    gather = starts[:, None] + torch.minimum(j[None, :], length[:, None] - 1)
    valid = (j[None, :] < length[:, None]).reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([length.new_zeros(1), torch.cumsum(length, 0)]).to(torch.int32)
    idx = {"gather": gather.to(device), "valid": valid.to(device), "n_real": sum(lens), "shape": (n, lmax),
           "cu": cu.to(device), "lmax": lmax}
    if seg_ids is not None:
        seg = seg_ids.to(device)[idx["gather"]]  # [n, Lmax]; padding columns repeat the last token's segment
        causal = torch.ones(lmax, lmax, dtype=torch.bool, device=device).tril()
        same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
        idx["mask"] = (causal[None] & same)[:, None]
    return idx


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, idx: dict[str, Any],
                     scaling: float | None, kernel: Kernel = sdpa, causal_mask: bool = False) -> torch.Tensor:
    """Causal attention of each packed sequence on its own. ``[1, H, T, D]`` in, ``[1, H, T, D]`` out
    (positions past the packed sequences get zeros). ``causal_mask``: hand the kernel an explicit causal
    mask (made once per layout) rather than ``causal=True`` alone, for kernels that would build one per call."""
    n, lmax = idx["shape"]
    g = idx["gather"]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [n, H, Lmax, D]
        return x[0][:, g].transpose(0, 1)

    mask = idx.get("mask")
    if mask is None and causal_mask:
        mask = idx.get("causal")
        if mask is None:
            mask = idx["causal"] = torch.ones(lmax, lmax, dtype=torch.bool, device=g.device).tril()
    out = kernel(pad(query), pad(key), pad(value), mask, True, scaling)
    h, d = out.shape[1], out.shape[3]
    flat = out.transpose(0, 1).reshape(h, n * lmax, d).index_select(1, idx["valid"])
    t = query.shape[2]
    if t > idx["n_real"]:
        flat = torch.cat([flat, flat.new_zeros(h, t - idx["n_real"], d)], dim=1)
    return flat[None]


def mask_segments(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32) and the longest segment of the rows of an engine-built causal mask
    ``[B, 1, L, L]`` (True = attend), flattened row after row.

    The engine's masks are block-diagonal causal (packed rows; a padding token sees itself only) or causal
    over right-padded rows: in both, token ``i`` starts a new segment exactly when it does not see token
    ``i - 1``. (A padded row's first padding token then joins the row's sequence and later ones stand alone:
    they see other keys than under the mask, but no real token ever sees them, and their outputs are
    dropped.)
    """
    b, length = mask.shape[0], mask.shape[-1]
    start = torch.ones(b, length, dtype=torch.bool, device=mask.device)
    start[:, 1:] = ~mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)
    pos = start.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([pos, pos.new_full((1,), b * length)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _flash_fn() -> Callable[..., torch.Tensor]:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_len: int,
                 n_tokens: int, scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """``flash_attn_varlen_func`` over the first ``n_tokens`` of the flattened ``[B, ·, L, D]`` rows, cut at
    ``cu``; ``[B, H, L, D]`` out, zeros past ``n_tokens``. kv heads may be fewer than query heads (GQA)."""
    b, h, length, d = query.shape

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [B*L, H, D]
        return x.transpose(1, 2).reshape(b * length, x.shape[1], d)[:n_tokens]

    q, k, v = flat(query), flat(key), flat(value)
    dtype = q.dtype
    if dtype not in (torch.float16, torch.bfloat16):  # flash-attn has no fp32 kernel
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = _flash_fn()(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling,
                      causal=True).to(dtype)
    if n_tokens < b * length:
        out = torch.cat([out, out.new_zeros(b * length - n_tokens, h, d)])
    return out.reshape(b, length, h, d).transpose(1, 2)
