"""Where mcore's training step makes gradient-sized temporaries, and what the engine runs instead.

mcore's DDP keeps every parameter's gradient in one contiguous fp32 buffer (``param.main_grad``). Around it,
the step made whole copies of the largest gradients: on a Qwen2.5-0.5B shape at t2p2 (the tied table's
``[V/t, H]`` shard is 0.27 GB) each of these sat beside the buffer and the AdamW moments at some point of the
step, and the ranks peaked 0.12 GiB over the state bound (docs/training.md):

- a module's backward makes its weight's gradient as a tensor of its own, which DDP's hook adds into the
  buffer and frees. Linear layers: mcore's own ``gradient_accumulation_fusion`` accumulates the weight
  gradient GEMM into ``main_grad`` (apex's ``fused_weight_gradient_mlp_cuda``); where apex is not installed
  (every CPU host, GPU hosts without it) :func:`enable_linear` gives mcore the same two functions in
  torch, one ``addmm_`` into the buffer. The vocabulary-parallel embedding has no such path in mcore (its
  lookup's backward is a dense ``[V/t, H]`` tensor): :func:`embedding_rows` makes it add its rows' gradients
  into ``main_grad`` (``sharded_vocab.add_rows``, fp32) and give autograd none: the hook adds nothing.
- the distributed optimizer's gradient reduce-scatter and parameter all-gather run even when the data-parallel
  group is one rank, where they are the identity; gloo's coalesced collectives copy the whole buffer to do
  them. :func:`skip_single_rank_sync` leaves out a collective whose output is its whole input.
- clipping: mcore's fallback scale (``local_multi_tensor_scale``, no apex) writes ``g.copy_(g * c)``, a
  temporary per gradient; the engine scales in place (``engine._optimizer_step``).

The first two need DDP's ``main_grad`` (a training engine); an inference-only engine keeps mcore's plain path.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from areal_cli.engines import sharded_vocab


class _TorchWgrad:
    """apex's ``fused_weight_gradient_mlp_cuda`` in torch: ``main_grad += grad_output^T @ input`` for 2-D
    ``input [n, in]`` and ``grad_output [n, out]`` (mcore flattens them first), in the buffer's dtype."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def enable_linear() -> bool:
    """Let mcore's ``gradient_accumulation_fusion`` run here: apex's kernel where it is installed, else
    :class:`_TorchWgrad`. Returns whether the torch one was installed. Idempotent."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return isinstance(getattr(layers, "fused_weight_gradient_mlp_cuda", None), _TorchWgrad)
    layers.fused_weight_gradient_mlp_cuda = _TorchWgrad()
    layers._grad_accum_fusion_available = True
    return True


class _RowsIntoMainGrad(torch.autograd.Function):
    """mcore's vocabulary-parallel lookup (ids outside ``[start, end)`` give zeros) whose backward adds the
    rows' gradients into ``weight.main_grad`` and returns none for the weight."""

    @staticmethod
    def forward(ctx, ids, weight, start, end):
        rows, mine = sharded_vocab.own_rows(ids, start, end - start)
        ctx.save_for_backward(rows, mine)
        ctx.weight = weight
        return F.embedding(rows, weight).masked_fill(~mine.unsqueeze(-1), 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        rows, mine = ctx.saved_tensors
        buf = getattr(ctx.weight, "main_grad", None)
        if buf is None:  # no DDP: the dense gradient, as mcore's own lookup gives it
            dense = torch.zeros_like(ctx.weight)
            sharded_vocab.add_rows(dense, rows, mine, g)
            return None, dense, None, None
        sharded_vocab.add_rows(buf, rows, mine, g)
        return None, None, None, None


def embedding_rows(chunks: list) -> int:
    """Route every ``VocabParallelEmbedding`` of ``chunks`` through :class:`_RowsIntoMainGrad` (not under
    mcore's deterministic mode, whose ``weight[ids]`` lookup this would change). Returns how many."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    def forward(self: Any, input_: torch.Tensor) -> torch.Tensor:
        out = _RowsIntoMainGrad.apply(input_, self.weight, self.vocab_start_index, self.vocab_end_index)
        if self.reduce_scatter_embeddings:  # as mcore's forward: [b s h] -> [s b h], then reduce-scatter
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(),
                                                              group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)

    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, VocabParallelEmbedding) and not m.deterministic_mode and m.weight.requires_grad:
                m.forward = types.MethodType(forward, m)
                n += 1
    return n


def _identity_skipped(orig: Any) -> Any:
    """``orig`` (a reduce-scatter or all-gather ``(output, input, ..., group=)``) that returns at once when it
    would be the identity: one rank, the output the whole input."""
    if getattr(orig, "_areal_single_rank", False):
        return orig

    def collective(output: torch.Tensor, input: torch.Tensor, *a: Any, group: Any = None, **k: Any) -> Any:
        if (group is not None and group.size() == 1 and output.data_ptr() == input.data_ptr()
                and output.numel() == input.numel()):
            return None
        return orig(output, input, *a, group=group, **k)

    collective._areal_single_rank = True  # type: ignore[attr-defined]
    return collective


def skip_single_rank_sync() -> None:
    """Leave out the grad buffer's reduce-scatter and the parameter buffer's all-gather (the distributed
    optimizer's) where the data-parallel group is one rank: gloo copies the whole buffer to do nothing.
    Idempotent."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    pgb.dist_reduce_scatter_func = _identity_skipped(pgb.dist_reduce_scatter_func)
    pgb.dist_all_gather_func = _identity_skipped(pgb.dist_all_gather_func)
