"""A tied input embedding whose gradient rows go straight into the head's gradient.

Why: with ``tie_word_embeddings`` the head's backward leaves a dense ``[V, H]`` gradient for the shared
weight, and the embedding's backward makes a second dense ``[V, H]`` gradient that autograd then adds to it,
although only the looked-up rows are nonzero. At a 152k vocabulary and hidden 896 that temporary is 0.51 GiB
in fp32, and under FSDP2 it is live beside the gathered table, the head's gradient and the reduce-scatter
input, at the end of the backward where the fsdp d4 step of a Qwen2.5-0.5B shape peaks (measured by
``benchmarks/engine_memory.py --peak``, docs/training.md: 4.43 → 3.99 GiB per rank at the steady step,
3.46 → 3.02 on the first, which runs before AdamW's moments exist). Here the lookup gives autograd no weight
gradient; it keeps the rows' gradients and adds them (``index_add_``) into the weight's gradient once autograd
has put the head's there (a post-accumulate-grad hook). Same sum, without the temporary.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _RowsIntoHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.needs_input_grad[1]:
            (ids,) = ctx.saved_tensors
            ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
            if ctx.padding_idx is not None:  # F.embedding gives the padding row no gradient
                keep = ids != ctx.padding_idx
                ids, grad = ids[keep], grad[keep]
            ctx.weight._areal_rows.append((ids, grad))
        return None, None, None


def _add_rows(param: torch.Tensor) -> None:
    rows, param._areal_rows = param._areal_rows, []
    for ids, g in rows:
        param.grad.index_add_(0, ids, g.to(param.grad.dtype))


def add_rows_into_tied_head(model) -> bool:
    """Route a tied ``nn.Embedding``'s gradient into the head's (see the module doc); False (and nothing
    changed) when the model's head is not tied to its input embedding."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = get_in() if get_in is not None else None
    head = get_out() if get_out is not None else None
    if not isinstance(emb, torch.nn.Embedding) or head is None or getattr(head, "weight", None) is not emb.weight:
        return False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # self.weight is the parameter in use now: FSDP2 swaps in its unsharded one for the forward.
        w = self.weight
        # fp32 weights only: rows added into a bf16 gradient round differently from autograd's dense sum
        # (the bf16 layouts' references compare to 1e-5), and its temporary is half the size there.
        if not w.requires_grad or not torch.is_grad_enabled() or w.dtype != torch.float32:
            return F.embedding(ids, w, self.padding_idx)
        if not hasattr(w, "_areal_rows"):
            w._areal_rows = []
            w.register_post_accumulate_grad_hook(_add_rows)
        return _RowsIntoHead.apply(ids, w, self.padding_idx)

    emb.forward = types.MethodType(forward, emb)
    return True
