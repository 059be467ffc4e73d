"""A tied embedding and LM head whose table stays row-sharded over every rank: never gathered
(``engine.tied_head``; fsdp over d x c, archon over d x c x t), and archon's TP embedding's own-rows lookup.

Why: FSDP2 gathers a unit's whole weight for its forward and backward. For the tied ``[V, H]`` table of a
Qwen2.5-0.5B shape (152k x 896, 0.51 GiB in fp32) that is the gathered table, the head's dense gradient and
the reduce-scatter's input, all live at the end of the backward, where the fsdp d4 step peaks: 1.5 GiB of
the 3.99 GiB a rank held (``benchmarks/engine_memory.py --peak``, docs/training.md). Here each rank keeps
its rows ``[start, start + V/n)`` of the table (a ``Shard(0)`` DTensor on the FSDP mesh, outside every FSDP
unit) and moves the tokens instead, as Megatron's vocabulary-parallel embedding and head do over TP:

- lookup: all ranks' token ids are gathered; each rank looks up the ones in its rows (zeros elsewhere) and
  a reduce-scatter (sum) hands every rank its own tokens' embeddings. Backward: the output gradients are
  gathered and each rank adds its rows' share into its shard's gradient.
- head: all ranks' hidden states are gathered; each rank computes the logits of its columns for all of
  them and :func:`token_logprobs.logprobs_entropy` reduces each token's log-normaliser over the group.
  Each rank keeps its own tokens' logprobs. Backward: the upstream gradients are gathered (every rank's
  columns need every token's), each rank's table gradient is then complete for its rows, and the hidden
  states' gradient is reduce-scattered (summed over the column shards) back to the tokens' owners.

The table's gradient is thus the sum over ranks, as FSDP's is here (divide factor 1, ``apply_fsdp``), and
already sharded. What it costs is the gathered activations: ``n x tokens x H`` per rank instead of the
table, so it wins while ``n x tokens`` is below about ``2V`` (``engine.tied_head=auto`` decides so).
Under archon's t the ranks of a TP group share their ids and the head's input: each looks up its slice of
the sequence, and the head's table gradient is divided by t (``dup``), each token being held t times.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from areal_cli.engines import token_logprobs
from areal_cli.utils import collectives


def _counts(n: int, group: Any) -> list[int]:
    """Every rank's token count, exchanged as host tensors: ``n`` is a shape the host already knows, while a
    device tensor's ``.tolist()`` would wait for the stream, twice per micro-batch (lookup and head). The
    engines' NCCL groups are ``cpu:gloo,cuda:nccl`` (utils/dist.py), so this is a gloo all-gather of ints that
    never touches the GPU; only a group without a CPU backend stages it through the device."""
    t = torch.tensor([n], dtype=torch.int64)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    collectives.all_gather_into_tensor(out, t, group=group)
    return out.tolist()


def _gather_rows(x: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """Every rank's ``x`` (``[counts[r], ...]``) concatenated in rank order."""
    most = max(max(counts), 1)
    if x.shape[0] < most:
        x = torch.cat([x, x.new_zeros((most - x.shape[0],) + tuple(x.shape[1:]))])
    out = x.new_empty((len(counts) * most,) + tuple(x.shape[1:]))
    collectives.all_gather_into_tensor(out, x.contiguous(), group=group)
    return torch.cat([out[r * most:r * most + c] for r, c in enumerate(counts)])


def _scatter_sum(x: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
    """Sum ``x`` (all ranks' rows, rank order) over the group and keep this rank's rows."""
    most = max(max(counts), 1)
    padded = x.new_zeros((len(counts) * most,) + tuple(x.shape[1:]))
    start = 0
    for r, c in enumerate(counts):
        padded[r * most:r * most + c] = x[start:start + c]
        start += c
    out = x.new_empty((most,) + tuple(x.shape[1:]))
    collectives.reduce_scatter_tensor(out, padded, group=group)
    return out[:counts[rank]]


class _GatherTokens(torch.autograd.Function):
    """Forward: every rank's rows. Backward: the rows' gradients summed over ranks, to their owner (times
    ``dup``: see :class:`_OwnTokens`)."""

    @staticmethod
    def forward(ctx, x, counts, rank, group, dup):
        ctx.counts, ctx.rank, ctx.group, ctx.dup = counts, rank, group, dup
        return _gather_rows(x, counts, group)

    @staticmethod
    def backward(ctx, g):
        out = _scatter_sum(g.contiguous(), ctx.counts, ctx.rank, ctx.group)
        return (out if ctx.dup == 1 else out * ctx.dup), None, None, None, None


class _OwnTokens(torch.autograd.Function):
    """Forward: this rank's rows of a tensor equal on every rank. Backward: every rank's rows' gradients
    (each rank's loss reads only its own tokens; every rank's columns need them all), over ``dup``: when
    each token sits on ``dup`` ranks (tensor-parallel peers holding the same hidden states, each with the
    same loss), the table's gradient would count it ``dup`` times. :class:`_GatherTokens` gives the
    hidden states their whole gradient back."""

    @staticmethod
    def forward(ctx, x, counts, rank, group, dup):
        ctx.counts, ctx.group, ctx.dup = counts, group, dup
        start = sum(counts[:rank])
        return x[:, start:start + counts[rank]].clone()

    @staticmethod
    def backward(ctx, g):
        out = _gather_rows(g.t().contiguous(), ctx.counts, ctx.group).t()
        return (out if ctx.dup == 1 else out / ctx.dup), None, None, None, None


def own_rows(ids: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, mine)``: each id's row in a shard holding rows ``[start, start + n)`` (0 where it is not
    there) and whether it is there. Also megatron's vocabulary-parallel lookup (megatron/grad_memory.py)."""
    mine = (ids >= start) & (ids < start + n)
    return torch.where(mine, ids - start, 0), mine


def add_rows(dst: torch.Tensor, rows: torch.Tensor, mine: torch.Tensor, g: torch.Tensor) -> None:
    """``dst[rows[i]] += g[i]`` where ``mine[i]``, in ``dst``'s dtype. The others add zeros to row 0: a
    boolean index (``rows[mine]``) has a data-dependent size, which a GPU learns only by waiting for the
    stream."""
    src = g.reshape(-1, g.shape[-1]).to(dst.dtype)
    dst.index_add_(0, rows.reshape(-1), torch.where(mine.reshape(-1, 1), src, 0.0))


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, local_w, start, padding_idx, group, rank, dtype):
        counts = _counts(ids.numel(), group)
        all_ids = _gather_rows(ids.reshape(-1), counts, group)
        rows, mine = own_rows(all_ids, start, local_w.shape[0])
        emb = F.embedding(rows, local_w.to(dtype)) * mine.unsqueeze(-1).to(dtype)
        ctx.save_for_backward(rows, mine if padding_idx is None else mine & (all_ids != padding_idx))
        ctx.counts, ctx.rank, ctx.group, ctx.shape = counts, rank, group, local_w.shape
        ctx.master_dtype = local_w.dtype
        return _scatter_sum(emb, counts, rank, group).view(*ids.shape, local_w.shape[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        rows, mine = ctx.saved_tensors
        g_all = _gather_rows(g.reshape(-1, g.shape[-1]).contiguous(), ctx.counts, ctx.group)
        gw = g_all.new_zeros(ctx.shape, dtype=torch.float32)  # the rows' sum in fp32, as the master
        add_rows(gw, rows, mine, g_all)
        return None, gw.to(ctx.master_dtype), None, None, None, None, None


def _row_start(vocab: int, rank: int, n: int) -> int:
    # DTensor's Shard(0) cuts as torch.chunk does: ceil(V / n) rows per rank, the last ones shorter
    return min(rank * -(-vocab // n), vocab)


def lookup(ids: torch.Tensor, weight: Any, padding_idx: int | None, compute_dtype: torch.dtype | None = None,
           seq_mesh: Any = None) -> torch.Tensor:
    """``F.embedding(ids, weight)`` for a ``Shard(0)`` DTensor ``weight`` of a 1-D mesh, whose ranks hold
    different ids: gathered, looked up where the rows are, summed back to their owner. ``seq_mesh``: a
    tensor-parallel mesh whose ranks share their ids (sequence parallel): each looks up its slice of the
    sequence and gets the ``Shard(1)`` DTensor the layers' plan takes. The gradient is the parameter's own
    shard (``to_local``), never a ``[V, H]`` one."""
    group = weight.device_mesh.get_group()
    rank, n = dist.get_rank(group), weight.device_mesh.size()
    start = _row_start(weight.shape[0], rank, n)
    dtype = compute_dtype or weight.dtype
    if seq_mesh is None or seq_mesh.size() == 1:
        return _Lookup.apply(ids, weight.to_local(), start, padding_idx, group, rank, dtype)
    from torch.distributed.tensor import DTensor, Shard

    parts, r, length = seq_mesh.size(), seq_mesh.get_local_rank(), ids.shape[1]
    if length % parts:
        raise ValueError(f"sequence length {length} is not a multiple of the {parts} sequence-parallel ranks")
    step = length // parts
    local = _Lookup.apply(ids[:, r * step:(r + 1) * step], weight.to_local(), start, padding_idx, group, rank,
                          dtype)
    return DTensor.from_local(local, seq_mesh, [Shard(1)], run_check=False)


def _rows_param(old: torch.nn.Parameter, mesh: Any) -> torch.nn.Parameter:
    """``old`` (meta: nothing is read or sent) as a ``Shard(0)`` DTensor parameter of ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return torch.nn.Parameter(distribute_tensor(old.detach(), mesh, [Shard(0)], src_data_rank=None),
                              requires_grad=old.requires_grad)


def shard_embedding(emb: torch.nn.Embedding, tp_mesh: Any) -> None:
    """A tensor-parallel embedding (archon's t, sequence parallel): the weight ``Shard(0)`` over ``tp_mesh``,
    each rank looking up its slice of the sequence (:func:`lookup`). What ``RowwiseParallel`` does, except
    its backward, which makes a replicated ``[V, H]`` gradient before keeping the rank's rows: 0.51 GiB for
    a 152k x 896 table, at the end of the backward where the step peaks."""
    emb.weight = _rows_param(emb.weight, tp_mesh)

    def forward(self, ids):
        return lookup(ids, self.weight, self.padding_idx, seq_mesh=tp_mesh)  # FSDP2's unsharded weight now

    emb.forward = types.MethodType(forward, emb)


class ShardedTable:
    """The row shard of a tied table on this rank and the two operations that use it (see the module doc).
    ``seq_mesh``: as in :func:`lookup`; its ranks also share the head's input, each token ``dup`` times."""

    def __init__(self, weight: torch.nn.Parameter, compute_dtype: torch.dtype | None, seq_mesh: Any = None):
        self.weight, self.compute_dtype, self.seq_mesh = weight, compute_dtype, seq_mesh
        self.group = weight.device_mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.start = _row_start(weight.shape[0], self.rank, weight.device_mesh.size())
        self.dup = 1 if seq_mesh is None else seq_mesh.size()

    def lookup(self, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        return lookup(ids, self.weight, padding_idx, self.compute_dtype, self.seq_mesh)

    def logprobs_entropy(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                         cutoffs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` ``[..., H]`` (the head's input at this rank's tokens), ``targets`` ``[...]``: this
        rank's tokens' fp32 ``(logprobs, entropy)``, as ``token_logprobs.logprobs_entropy`` of the logits."""
        shape, dev = targets.shape, hidden.device
        h = hidden.reshape(-1, hidden.shape[-1])
        counts = _counts(h.shape[0], self.group)
        h_all = _GatherTokens.apply(h, counts, self.rank, self.group, self.dup)
        t_all = _gather_rows(targets.reshape(-1).to(dev), counts, self.group)
        c_all = None if cutoffs is None else _gather_rows(cutoffs.reshape(-1).to(dev).float(), counts, self.group)
        with torch.autocast(dev.type, enabled=False):  # the head computes in fp32 (precision.fp32_head)
            w = self.weight.to_local()  # its gradient comes back as the parameter's own Shard(0) DTensor
            logits = F.linear(h_all.float(), w.to(self.compute_dtype or w.dtype).float())
        lp, ent = token_logprobs.logprobs_entropy(logits, t_all, temperature, c_all, group=self.group,
                                                  start=self.start)
        own = _OwnTokens.apply(torch.stack([lp, ent]), counts, self.rank, self.group, self.dup)
        return own[0].view(shape), own[1].view(shape)


def eligible(model) -> str | None:
    """Why the model's head cannot use a sharded table (``None``: it can)."""
    from areal_cli.engines import vision

    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is not emb.weight:
        return "the model's head is not tied to its input embedding (tie_word_embeddings=false)"
    if not isinstance(emb, torch.nn.Embedding) or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return f"the head is a {type(head).__name__}, not a bias-free Linear beside an nn.Embedding"
    if vision.is_vl_config(model.config):
        return "a vision-language model's embedding feeds its image hooks whole"
    cfg = vision.text_config(model.config)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return "the model scales or caps its logits after the head"
    return None


def install(model, mesh, compute_dtype: torch.dtype | None, seq_mesh: Any = None) -> ShardedTable:
    """Make the tied table a ``Shard(0)`` meta DTensor on ``mesh`` (materialised with the model, outside every
    FSDP unit: pass it to ``apply_fsdp(ignored_params=…)``), the embedding look up through it and the head
    return its input (the engine computes logprobs with :meth:`ShardedTable.logprobs_entropy`).

    ``seq_mesh``: a tensor-parallel mesh whose ranks share their input ids (archon's t, sequence parallel):
    each looks up its slice of the sequence and the embedding returns the ``Shard(1)`` DTensor the layers'
    plan takes, as archon's ``RowwiseParallel`` embedding did."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    emb.weight = head.weight = _rows_param(emb.weight, mesh)
    return route(model, ShardedTable(emb.weight, compute_dtype, seq_mesh))


def route(model, table: ShardedTable) -> ShardedTable:
    """The model's embedding looks up through ``table`` and its head returns its input (the engine computes
    logprobs with :meth:`ShardedTable.logprobs_entropy`). Returns ``table``."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()

    def forward(self, ids):
        return table.lookup(ids, self.padding_idx)

    emb.forward = types.MethodType(forward, emb)
    head.forward = types.MethodType(lambda self, x: x, head)
    return table


def wanted(mode: str, max_tokens: Any, model, n_ranks: int, refuse: str | None = None) -> bool:
    """``engine.tied_head`` for a model on ``n_ranks`` ranks that would share the table: whether to keep it
    row-sharded. ``refuse``: why this layout cannot (``sharded`` is then refused, ``auto`` gathers)."""
    from areal_cli.config.engine import TIED_HEAD_MODES
    from areal_cli.engines import vision
    from areal_cli.errors import ConfigError

    if mode not in TIED_HEAD_MODES:
        raise ConfigError("engine.tied_head", f"unknown mode {mode!r}", f"use one of: {', '.join(TIED_HEAD_MODES)}")
    if mode == "gathered" or n_ranks == 1:
        return False
    why = refuse or eligible(model)
    if mode == "sharded":
        if why:
            raise ConfigError("engine.tied_head", f"'sharded' cannot run here: {why}",
                              "leave engine.tied_head=auto")
        return True
    tokens = max_tokens if isinstance(max_tokens, int) else 4096
    return why is None and n_ranks * tokens < 2 * vision.text_config(model.config).vocab_size
