"""Pipeline parallelism for HF causal LMs with ``torch.distributed.pipelining``.

A stage is the HF module tree itself, trimmed: :class:`StageModule` holds ``.model`` (the HF base
model, with the decoder layers other stages own replaced by parameter-free pass-throughs) and, on
the last stage, ``.lm_head``. Parameter names therefore stay HF names (``model.layers.7.mlp...``),
with the original layer indices, on every stage.

Each step may have its own sequence length: a step whose shapes differ from the last one gets a
fresh schedule (:meth:`Pipeline.train_step`), which re-infers the stages' activation shapes: the
engine pads lengths to buckets (:func:`bucket_length`) so that steps reuse schedules. Within a step all micro-batches share one shape (pad
them with :func:`pad_stack`). Losses go through the schedule with ``scale_grads=False``: the loss of
micro-batch ``i`` is scaled by ``weight_i / global_weight`` (:class:`MicroBatchLoss`), the engine's
global normalisation, so gradients add up exactly as without pipelining.

Tied embeddings: the last stage gets its own copy of the embedding as ``lm_head.weight`` (marked
``tied_copy``); after backward the two copies' gradients are summed between the first and the last
stage (Megatron's "embedding group"), so both copies take the same optimizer steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from areal_cli.engines import precision
from areal_cli.engines.archon import SCHEDULES
from areal_cli.errors import ConfigError
from areal_cli.utils import collectives


def schedule_class(name: str):
    """The torch schedule class for ``name`` (one of :data:`SCHEDULES`)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B, "GPipe": ScheduleGPipe}
    if name not in classes:
        raise ConfigError("engine.archon.pp_schedule", f"unknown pipeline schedule {name!r}",
                          f"use one of {', '.join(SCHEDULES)}")
    return classes[name]


def is_multi_stage(name: str) -> bool:
    """Whether the schedule runs several (virtual) stages per rank."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(schedule_class(name), PipelineScheduleMulti)


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    if is_multi_stage(schedule):
        if virtual_stages < 2:
            raise ConfigError("engine.archon.pp_virtual_stages", f"{schedule} needs at least 2 stages per rank, "
                              f"got {virtual_stages}", "set engine.archon.pp_virtual_stages=2 or use 1F1B")
        return virtual_stages
    if virtual_stages != 1:
        raise ConfigError("engine.archon.pp_virtual_stages",
                          f"{schedule} runs one stage per rank, got {virtual_stages}",
                          "use Interleaved1F1B for virtual stages, or set engine.archon.pp_virtual_stages=1")
    return 1


def split_layers(n_layers: int, n_stages: int,
                 layers_per_stage: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``[lo, hi)`` decoder-layer ranges of the ``n_stages`` stages, in stage order.

    Even split by default; the remainder goes to the stages after the first, which also carries the
    embeddings (and the last carries the LM head).
    """
    if layers_per_stage is not None:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != n_stages or any(c < 0 for c in counts) or sum(counts) != n_layers:
            raise ConfigError("engine.archon.pp_layers", f"{list(layers_per_stage)} is not {n_stages} "
                              f"non-negative layer counts summing to num_hidden_layers={n_layers}",
                              f"give {n_stages} counts that add up to {n_layers}, or leave it empty")
    else:
        if n_stages > n_layers:
            raise ConfigError("allocation_mode", f"{n_stages} pipeline stages for {n_layers} layers",
                              "use fewer stages (p × virtual stages ≤ num_hidden_layers)")
        base, extra = divmod(n_layers, n_stages)
        order = list(range(1, n_stages)) + [0]
        counts = [base] * n_stages
        for s in order[:extra]:
            counts[s] += 1
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


def stage_ids(pp_rank: int, pp_size: int, per_rank: int) -> list[int]:
    """Stages of a rank, loop style (rank r holds r, r+p, r+2p, ...), as Interleaved1F1B expects."""
    return [pp_rank + k * pp_size for k in range(per_rank)]


def valid_microbatch_count(schedule: str, pp_size: int, n: int) -> int:
    """The smallest micro-batch count ``≥ n`` the schedule accepts (pad with zero-weight ones)."""
    n = max(1, int(n))
    if schedule == "1F1B":
        return max(n, pp_size)
    if is_multi_stage(schedule):
        while n % max(1, n // pp_size):  # Interleaved1F1B runs n in rounds of n // pp
            n += 1
    return n


def bucket_length(length: int, multiple: int = 1, cap: int | None = None) -> int:
    """The padded length a step's micro-batches share: ``length`` rounded up to a multiple of
    ``max(64, 2**floor(log2(length)) / 8)`` (eight buckets per power of two: less than 1/8 of ``length``
    or 64 tokens of padding), then to a multiple of ``multiple``; never above ``cap`` rounded up to ``multiple`` (the
    token budget of a micro-batch) unless ``length`` itself is. A step whose length differs from the last
    one's pays a fresh schedule (an extra forward and backward of one micro-batch for torch's shape
    inference); with one bucket per eighth of an octave, steps of similar lengths reuse it."""
    if length <= 0:
        return max(1, multiple)
    grain = max(64, (1 << (length.bit_length() - 1)) // 8)
    out = -(-length // grain) * grain
    out = -(-out // multiple) * multiple
    if cap is not None and cap > 0:
        out = min(out, max(-(-cap // multiple) * multiple, -(-length // multiple) * multiple))
    return out


def pad_stack(tensors: Sequence[torch.Tensor], *, length: int | None = None, dims: Sequence[int] = (1,),
              value: Any = 0) -> torch.Tensor:
    """Right-pad every tensor along ``dims`` to ``length`` (default: the longest) and concatenate
    along dim 0: a step's micro-batches as the one tensor the schedule splits."""
    length = length or max(t.shape[d] for t in tensors for d in dims)
    out = []
    for t in tensors:
        for d in dims:
            if t.shape[d] < length:
                shape = list(t.shape)
                shape[d] = length - t.shape[d]
                t = torch.cat([t, t.new_full(shape, value)], dim=d)
        out.append(t)
    return torch.cat(out, dim=0)


def pad_stack_masks(masks: Sequence[torch.Tensor], *, length: int | None = None) -> torch.Tensor:
    """:func:`pad_stack` for boolean ``[b, 1, T, T]`` attention masks: padded positions attend to
    themselves only (an all-False row would make softmax NaN)."""
    length = length or max(m.shape[-1] for m in masks)
    out = pad_stack(masks, length=length, dims=(2, 3), value=False)
    eye = torch.eye(length, dtype=torch.bool, device=out.device)
    pad = torch.zeros(out.shape[0], 1, length, 1, dtype=torch.bool, device=out.device)
    row = 0
    for m in masks:
        pad[row:row + m.shape[0], :, m.shape[-1]:] = True
        row += m.shape[0]
    return out | (eye & pad)


class _SkippedLayer(nn.Module):
    """A decoder layer another stage owns: hands the hidden states through."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class StageModule(nn.Module):
    """One pipeline stage of an HF causal LM (see the module docstring).

    ``forward(x, position_ids, attention_mask=None, **model_kwargs)``: ``x`` is ``input_ids``
    ``[b, T]`` on the first stage and the previous stage's hidden states elsewhere;
    ``attention_mask`` is an explicit boolean ``[b, 1, T, T]`` mask (True = attend) used for every
    layer type, or ``None`` to let HF build its causal (or, from restarting ``position_ids``,
    packed-sequence) mask. The last stage returns logits (this rank's vocab slice under TP), or
    ``output_fn(logits, targets)`` when that is set (``targets``: this micro-batch's slice of the
    ``targets`` keyword, e.g. next-token ids for logprobs; ignored by the other stages). Other
    stages return hidden states; under sequence parallelism they travel as this rank's sequence
    slice (``seq_mesh``).
    """

    def __init__(self, base: nn.Module, lm_head: nn.Module | None, config: Any, *, stage_index: int,
                 num_stages: int, layers: tuple[int, int], tied_copy: bool = False):
        super().__init__()
        self.config = config
        self.model = base
        self.lm_head = lm_head
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_range = layers
        self.tied_copy = tied_copy
        self.seq_mesh = None  # set by parallelize when hidden states are sequence-sharded DTensors
        self.output_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                **model_kwargs: Any) -> torch.Tensor:
        # A 4-D mask passes through HF's mask creation unchanged for every family (a dict of masks
        # per layer type is understood by Qwen2/Qwen3 but not by Llama).
        masks = attention_mask
        if self.is_first:
            out = self.model(input_ids=x, position_ids=position_ids, attention_mask=masks, use_cache=False,
                             **model_kwargs)
        else:
            if self.seq_mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                x = DTensor.from_local(x, self.seq_mesh, [Shard(1)], run_check=False)
            out = self.model(inputs_embeds=x, position_ids=position_ids, attention_mask=masks,
                             use_cache=False, **model_kwargs)
        h = out.last_hidden_state
        if not self.is_last:
            return h.to_local() if hasattr(h, "to_local") else h
        logits = self.lm_head(h)
        return self.output_fn(logits, targets) if self.output_fn is not None else logits


def _detach_parts(base: nn.Module) -> dict[str, Any]:
    parts = {"layers": base.layers, "embed_tokens": getattr(base, "embed_tokens", None),
             "norm": getattr(base, "norm", None)}
    base.layers = nn.ModuleList()
    base.embed_tokens = None
    base.norm = None
    return parts


def build_stage_modules(model: nn.Module, *, pp_rank: int, pp_size: int, schedule: str = "1F1B",
                        virtual_stages: int = 1,
                        layers_per_stage: Sequence[int] | None = None) -> list[StageModule]:
    """Cut ``model`` (an HF causal LM: ``.model`` base with ``.layers``, ``.lm_head``) into this rank's
    stage modules, in stage order. The owned layers, embeddings, norm and head are *moved* out of
    ``model`` (not copied); only the small skeleton of the base model is copied per stage. ``model``
    is unusable afterwards.
    """
    if pp_size < 2:
        raise ConfigError("allocation_mode", f"pipelining needs p ≥ 2, got p{pp_size}", "drop the pipeline")
    per_rank = stages_per_rank(schedule, virtual_stages)
    n_stages = pp_size * per_rank
    base = model.model
    n_layers = len(base.layers)
    ranges = split_layers(n_layers, n_stages, layers_per_stage)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    lm_head = model.lm_head
    parts = _detach_parts(base)
    skeleton = copy.deepcopy(base)  # rotary embedding, config: small
    mods = []
    for sid in stage_ids(pp_rank, pp_size, per_rank):
        lo, hi = ranges[sid]
        first, last = sid == 0, sid == n_stages - 1
        b = copy.deepcopy(skeleton)
        b.layers = nn.ModuleList([parts["layers"][j] if lo <= j < hi else _SkippedLayer()
                                  for j in range(n_layers)])
        b.embed_tokens = parts["embed_tokens"] if first else None
        b.norm = parts["norm"] if last else _SkippedLayer()
        head, tied_copy = None, False
        if last:
            head = lm_head
            if tied:
                # A separate parameter: the first stage (another rank) owns the embedding itself.
                head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False,
                                 dtype=lm_head.weight.dtype, device=lm_head.weight.device)
                emb = parts["embed_tokens"].weight  # frozen under LoRA: so is the copy
                head.weight = nn.Parameter(emb.detach().clone(), requires_grad=emb.requires_grad)
                precision.fp32_head(head)  # as the model's own head (engines/precision.py)
                tied_copy = True
        mods.append(StageModule(b, head, model.config, stage_index=sid, num_stages=n_stages, layers=(lo, hi),
                                tied_copy=tied_copy))
    return mods


class MicroBatchLoss:
    """The schedule's ``loss_fn``: ``target`` carries the micro-batch index, ``fn(output, index)``
    returns that micro-batch's loss (a mean over its units) and stats; the loss is scaled by
    ``weights[index] / global_weight``. Records per index (idempotent: torch's metadata inference
    also calls it once on micro-batch 0)."""

    def __init__(self, fn: Callable[[torch.Tensor, int], "tuple[torch.Tensor, dict[str, float]]"],
                 weights: Sequence[float], global_weight: float):
        self.fn = fn
        self.weights = [float(w) for w in weights]
        self.global_weight = float(global_weight) if global_weight > 0 else 1.0
        # Tensors until the step ends: a host read per micro-batch would stall the stream between them.
        self.scaled_loss_tensors: dict[int, torch.Tensor] = {}
        self.stats: dict[int, dict[str, Any]] = {}

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        i = int(target.reshape(-1)[0])  # the schedule's target: a host tensor, no device read
        loss, stats = self.fn(output, i)
        scaled = loss * (self.weights[i] / self.global_weight)
        self.scaled_loss_tensors[i] = scaled.detach()
        self.stats[i] = dict(stats)
        return scaled

    @property
    def scaled_losses(self) -> dict[int, float]:
        """The recorded scaled losses as numbers (one host read for all of them)."""
        from areal_cli.engines.step_stats import read_floats

        host = read_floats(list(self.scaled_loss_tensors.values()))
        return {i: host[id(t)] for i, t in self.scaled_loss_tensors.items()}


class Pipeline:
    """This rank's stages and their ``PipelineStage`` wrappers; a schedule per step shape."""

    def __init__(self, modules: list[StageModule], mesh: Any, schedule: str, device: torch.device):
        from torch.distributed.pipelining import PipelineStage

        self.modules = modules
        self.schedule = schedule
        self.mesh = mesh
        self.pp_group = mesh.pp_group
        self.stages = [PipelineStage(m, m.stage_index, m.num_stages, device, group=self.pp_group)
                       for m in modules]
        self.has_first = any(m.is_first for m in modules)
        self.has_last = any(m.is_last for m in modules)
        self._embedding_group = _embedding_group(mesh) if _is_tied(modules) else None
        self._loss_slot = _LossSlot()
        self._last: tuple | None = None  # (key, schedule) of the schedule that last set up the stages
        self.schedules_built = 0
        # NCCL reduces device tensors only; the reuse flag goes where the default group can reduce it.
        self._flag_device = device if "nccl" in str(dist.get_backend()) else torch.device("cpu")

    # ---- parameters
    def named_parameters(self):
        """``(HF name, parameter)`` over this rank's stages; the last stage's tied copy of the
        embedding appears as ``lm_head.weight``."""
        for m in self.modules:
            yield from m.named_parameters()

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def norm_parameters(self) -> list[torch.Tensor]:
        """Parameters that count towards the gradient norm: all but a tied copy."""
        return [p for m in self.modules for n, p in m.named_parameters()
                if not (m.tied_copy and n == "lm_head.weight")]

    # ---- steps
    def _schedule(self, mode: str, n_microbatches: int, input_ids: torch.Tensor | None, kwargs: dict):
        """The last schedule again when this step has the same mode and shapes on every rank, else a
        fresh one. A fresh schedule makes torch infer the stage's activation shapes by running one
        extra forward (and input backward) of micro-batch 0, which costs ~1/n of the step; reuse
        is safe only for the schedule that last initialised the stages (their buffers are its)."""
        key = (mode, n_microbatches, _shapes(input_ids if self.has_first else None), _shapes(kwargs))
        hit = self._last is not None and self._last[0] == key
        same = torch.tensor([1 if hit else 0], device=self._flag_device)
        # Every rank decides alike: a skipped shape inference on one rank would leave its peers'
        # metadata exchange (and FSDP collectives in the inference forward) unanswered.
        collectives.all_reduce(same, op=collectives.ReduceOp.MIN)
        if bool(same.cpu().item()):
            return self._last[1]
        cls = schedule_class(self.schedule)
        stages = self.stages if is_multi_stage(self.schedule) else self.stages[0]
        loss_fn = self._loss_slot if mode == "train" else None
        sched = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self._last = (key, sched)
        self.schedules_built += 1
        return sched

    def train_step(self, input_ids: torch.Tensor | None, *, n_microbatches: int, loss: MicroBatchLoss,
                   **model_kwargs: Any) -> None:
        """Forward and backward of ``n_microbatches`` micro-batches (row blocks of ``input_ids``
        ``[n·b, T]`` and of every tensor in ``model_kwargs``); gradients accumulate into the stage
        parameters, tied-embedding gradients are summed. ``input_ids`` is needed on the first stage's
        ranks only; ``model_kwargs`` (``position_ids``, ``attention_mask``, ...) on every rank.
        Collective over the whole world (all ranks call it, each with its replica's batch)."""
        sched = self._schedule("train", n_microbatches, input_ids, model_kwargs)
        self._loss_slot.fn = loss
        args = (input_ids,) if self.has_first else ()
        target = torch.arange(n_microbatches) if self.has_last else None
        try:
            sched.step(*args, target=target, return_outputs=False, **model_kwargs)
        finally:
            self._loss_slot.fn = None
        self.sync_tied_grads()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None, *, n_microbatches: int,
                output_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
                **model_kwargs: Any) -> torch.Tensor | None:
        """Forward only. On the last stage's ranks returns the outputs of all micro-batches
        concatenated along dim 0: ``output_fn(logits, targets)`` when given (keep it small, e.g.
        per-token logprobs and entropy, rather than ``[T, V]`` logits; pass ``targets=`` among the
        keywords to have it split per micro-batch), else the logits. ``None`` on other ranks."""
        for m in self.modules:
            if m.is_last:
                m.output_fn = output_fn
        try:
            sched = self._schedule("eval", n_microbatches, input_ids, model_kwargs)
            args = (input_ids,) if self.has_first else ()
            out = sched.step(*args, **model_kwargs)
        finally:
            for m in self.modules:
                m.output_fn = None
        return out if self.has_last else None

    def tied_rows(self):
        """This rank's copy of a tied table as a :class:`tied_rows.TiedRows` (its AdamW moments split by rows
        with the other end's holder), or None: no tied table, a frozen one, or none on this rank."""
        from areal_cli.engines.archon.tied_rows import TiedRows

        if self._embedding_group is None or (self.has_first and self.has_last):
            return None
        for m in self.modules:
            p = m.model.embed_tokens.weight if m.is_first else m.lm_head.weight if m.is_last else None
            if p is not None and p.requires_grad:
                return TiedRows(p, self._embedding_group, first=m.is_first)
        return None

    def sync_tied_grads(self) -> None:
        """Sum the tied embedding's gradient over its two copies (first and last stage)."""
        if self._embedding_group is None:
            return
        for m in self.modules:
            if m.is_first:
                p = m.model.embed_tokens.weight
            elif m.is_last:
                p = m.lm_head.weight
            else:
                continue
            if not p.requires_grad:  # frozen (LoRA's base): both copies alike, no gradient to sum
                continue
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
                p.grad = g
            if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                # Under TP the embedding's gradient comes back Replicate while the parameter (and the
                # head's copy) is vocab-sharded: bring both copies to the same local layout first.
                g = g.redistribute(p.device_mesh, p.placements)
                p.grad = g
            local = g.to_local() if hasattr(g, "to_local") else g
            collectives.all_reduce(local, group=self._embedding_group)


class _LossSlot:
    """The loss_fn a cached schedule holds on to; each step plugs its own loss in."""

    def __init__(self):
        self.fn: Callable | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.fn is None:
            raise RuntimeError("pipeline loss called outside train_step")
        return self.fn(output, target)


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_shapes(v) for v in x)
    return repr(x)


def _is_tied(modules: list[StageModule]) -> bool:
    # Every rank must agree (creating the group is collective), so the config decides, not the
    # stages this rank happens to hold.
    return bool(getattr(modules[0].config, "tie_word_embeddings", False))


def _embedding_group(mesh: Any):
    """The group of the first and last pipeline rank that share this rank's (dp, cp, tp)
    coordinates; ``new_group`` is collective, so every rank creates every pair in the same order."""
    if mesh.dims.pp == 2:
        return mesh.pp_group
    grid = mesh.world.mesh  # [pp, dp, cp, tp] global ranks
    mine = None
    me = dist.get_rank()
    flat = grid.reshape(grid.shape[0], -1)
    for j in range(flat.shape[1]):
        ranks = [int(flat[0, j]), int(flat[-1, j])]
        g = dist.new_group(ranks)
        if me in ranks:
            mine = g
    return mine
