"""The Megatron engine: megatron-core ``GPTModel`` chunks under mcore's DDP, optimizer and pipeline schedules.

TP, PP (with interleaved virtual stages) and DP come from ``megatron.core.parallel_state``; sequence
parallelism rides on TP. The same code runs on CUDA/NCCL and on CPU/gloo (:mod:`.compat`'s patches, applied only
when CUDA is absent); ``engine.attn_impl`` picks the layer spec (:mod:`.model`: the local one with sdpa or eager
core attention, TransformerEngine's with its flash backend for flash_attention_2).

What it shares with every backend it inherits from :class:`~areal_cli.engines.base.EngineBase`: micro-batch
splitting and the global loss normalisation (``weight / global weight``), stats reduction, HF export and the weight-sync senders
(fed by :meth:`_named_full_tensors`). What is mcore's own is here:

- Micro-batches are right-padded rows with an explicit ``[b, 1, s, s]`` mask (True = hidden): without
  TransformerEngine, mcore cannot pack several sequences into one row (rope positions restart per sequence
  only under TE's THD format).
- mcore divides each micro-batch loss by the number of micro-batches, and its DDP scales gradients by 1/dp
  before summing them: the loss handed to mcore is multiplied by both, so the gradients are the engine's
  global normalisation, as under FSDP.
- Logprobs and entropy come from vocab-parallel logits ``[b, s, V/t]`` without gathering the vocabulary
  (the Archon engine's vocab-parallel kernels), and a critic's value head replaces the output layer.
- Learning-rate schedules are the engine's own (set on the optimizer's param groups before each step);
  clipping is mcore's (its norm counts TP-sharded parameters once, over TP, PP and, with the distributed
  optimizer, DP).
- Weights are read from the safetensors slice by slice (:class:`~.convert.TensorSource`): a rank reads only what
  its chunks hold and never builds the HF model. Export gathers on data-parallel replica 0 only.
- Checkpoints: model chunks once per model-parallel position (data-parallel replica 0 writes them), the inner
  optimizers' state and master weights per rank under the distributed optimizer (each holds a shard), else
  with the chunks (replicated): they resume bit-exact at the same layout. An HF export loads into any layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch
from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
from areal_cli.engines import attn_impl, packing, precision, sampling_mask, step_stats
from areal_cli.engines import parallelize as par
from areal_cli.engines.megatron import SPEC, check_virtual_stages, grad_memory, masters
from areal_cli.engines.megatron.parallel_state import ParallelState
from areal_cli.engines import routing_replay as r3
from areal_cli.config.engine import RECOMPUTE_GRANULARITIES
from areal_cli.engines.base import VALUE_HEAD_FILE, EngineBase, init_value_head
from areal_cli.errors import ConfigError
from areal_cli.utils import collectives, host_memory
from areal_cli.utils.dist import send_to_rank0

# a checkpoint dir: per rank, its step, version, extra state and (distributed optimizer) optimizer shard; per
# model-parallel position, the model chunks (and the replicated optimizer state without the distributed one),
# written once by the position's first rank, not once per data-parallel replica
CKPT_FILE = "megatron_rank{rank}.pt"
MODEL_FILE = "megatron_model_pp{pp}_tp{tp}_ep{ep}_etp{etp}.pt"


class _Coord(NamedTuple):
    """A rank's pipeline, tensor, data-parallel, expert-parallel, expert-TP and expert-data-parallel ranks."""

    pp: int
    tp: int
    dp: int
    ep: int
    etp: int
    edp: int


class ValueHead(torch.nn.Module):
    """A critic's ``Linear(hidden, 1)`` in the output layer's place, replicated on every TP rank.

    Called as mcore calls its output layer (``[s, b, h]`` in, ``(out, bias)`` back). Under sequence
    parallelism the hidden states arrive cut along the sequence: they are gathered first, so every TP rank sees
    whole rows and computes the same values and gradients; the backward then only keeps each rank's slice
    (a reduce-scatter would count the t identical copies t times).
    """

    def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.head = precision.fp32_head(torch.nn.Linear(hidden, 1, bias=True, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **_: Any):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.head(hidden), None


class MegatronEngine(EngineBase):
    """megatron-core TP × PP (× virtual stages) × DP (× EP for Qwen3-MoE) training of Qwen2/2.5, Qwen3, Llama and
    Qwen3-MoE models."""

    dims = SPEC.dims  # its spec (engines/megatron/__init__.py) is the one place that says them

    # ------------------------------------------------------------------ setup
    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        from areal_cli.engines.megatron import compat, convert, routing
        from areal_cli.engines.megatron import model as mm
        from areal_cli.utils.dist import default_device, init_distributed

        init_distributed()
        self.device = torch.device(kwargs.get("device") or default_device())
        self.parallel, self.model_path = parallel, model_path
        if parallel.cp > 1:
            raise ConfigError("allocation_mode.spec", "engine=megatron does not run context parallelism (c) in "
                              "this release: mcore's needs TransformerEngine's attention",
                              "drop c, or use engine=archon (Ulysses c)")
        if not (Path(model_path) / "config.json").is_file():
            raise ConfigError("model.path", f"{model_path} is not an HF model dir (no config.json)",
                              "point model.path at a local dir with config.json and safetensors")
        compat.check_version()
        attn_impl.check(self.cfg.attn_impl, "megatron", self.device.type,
                        bf16_compute=self.cfg.dtype == "bfloat16")
        if self.device.type == "cpu":
            compat.apply_cpu_compat()
        mc = self.cfg.megatron
        tp, pp, vpp = parallel.tp, parallel.pp, int(mc.virtual_stages)
        ep, etp = parallel.ep, parallel.etp or parallel.tp
        check_virtual_stages(vpp, pp)
        dtype = par.torch_dtype(self.cfg.dtype)
        hf_config = self._read_hf_config(model_path)
        self.mc_arch = arch = mm.hf_arch(hf_config)
        mm.check_layout(arch, tp, pp, vpp, ep, etp)
        self._init_parallel_state(tp, pp, vpp, ep, etp, kwargs.get("peers", ()))
        self.sequence_parallel = bool(mc.sequence_parallel) and tp > 1
        # bf16 compute: mcore's bf16 mode, fp32 master weights in the optimizer (engines/precision.py)
        mixed = dtype == torch.bfloat16
        training = self.optim_cfg is not None
        if training:  # no whole-gradient temporaries beside DDP's fp32 buffer (grad_memory.py)
            grad_memory.enable_linear()
            grad_memory.skip_single_rank_sync()
        config = mm.transformer_config(arch, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                                       sequence_parallel=self.sequence_parallel,
                                       dtype=torch.bfloat16 if mixed else torch.float32,
                                       aux_loss_coeff=float(mc.moe_aux_loss_coeff), attn_impl=self.cfg.attn_impl,
                                       wgrad_into_main_grad=training, loaded=True)
        self._recompute(config)
        self.tconfig = config
        torch.manual_seed(self.seed)  # mcore's own init (overwritten by the load) draws the same as before
        if self.device.type == "cuda":
            # mcore initialises weights on the GPU inside its CUDA RNG tracker's model-parallel state
            # (tensor_parallel/layers.py _initialize_affine_weight_gpu); without it "cuda rng state
            # model-parallel-rng is not added" (seen on an H200, docs/gpu_check.md). On CPU the compat
            # shim's inference tracker stands in.
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(self.seed)
        chunks = mm.build_chunks(arch, config, attn_impl=self.cfg.attn_impl)
        if self.critic:
            for c in chunks:
                if c.post_process:
                    c.output_layer = ValueHead(arch.hidden_size, self.sequence_parallel, config.params_dtype)
        self.experts = self._expert_layout(ep, etp)
        for c in chunks:
            c.to(self.device)
        # this rank's slices only, read from the safetensors (never the whole model on a rank)
        source = self._hf_source(model_path, dtype, init_head=True)
        # The distributed optimizer's DDP copies every parameter into its contiguous buffer: loaded after that,
        # into the buffer's views, the weights are never held twice (model.hollow).
        load_after_ddp = training and bool(self.cfg.megatron.use_distributed_optimizer)
        if load_after_ddp:
            mm.hollow(chunks)
        else:
            convert.load_hf(chunks, source, arch, self.tp_rank, tp, self.experts)
        self.chunks = chunks
        self._routing = (routing.ChunkRouting(chunks, arch.num_layers, arch.moe_top_k, device=self.device)
                         if arch.num_experts else None)
        if training:
            grad_memory.embedding_rows(chunks)
            self.model = torch.nn.ModuleList(self._wrap_ddp(chunks, config))
            if load_after_ddp:
                convert.load_hf(chunks, source, arch, self.tp_rank, tp, self.experts)
            self._build_mcore_optimizer(mixed)
            if mixed:
                masters.restore(self, model_path)
        else:
            self.model = torch.nn.ModuleList(chunks)
            self.model.eval()
        self._coords = self._gather_coords()
        host_memory.release()  # the slices' source tensors, freed under the kept chunks

    def _read_hf_config(self, model_path: str) -> Any:
        """The HF config and what the export writes beside the weights (the base's model-dir reading), without
        building the HF model: that would read and hold the whole model on every rank."""
        cfg = self._read_model_meta(model_path)
        if self.critic:  # the value head replaces the vocab projection: the tie is broken, as fsdp's critic
            cfg.tie_word_embeddings = False
        self.hf_config = cfg
        return cfg

    def _hf_source(self, path: str, dtype: Any, init_head: bool = False) -> Any:
        """A :class:`~.convert.TensorSource` over the safetensors of ``path`` (read lazily, slice by slice), cast
        to ``dtype`` (None: as stored), with a critic's value head from ``value_head.safetensors``; without
        that file, ``init_head`` initialises the head as fsdp's critic does (same seed, same draws)."""
        from areal_cli.engines.megatron.convert import TensorSource
        from areal_cli.weight_sync.hf_io import HFCheckpoint

        ckpt = HFCheckpoint(path)
        if not ckpt.names():
            raise ConfigError("model.path", f"{path} has no model*.safetensors weights",
                              "point at an HF model dir with safetensors weights (or an export of this tool)")
        head: dict[str, torch.Tensor] = {}
        if self.critic:
            src = Path(path) / VALUE_HEAD_FILE
            if src.is_file():
                from safetensors.torch import load_file

                head = {f"lm_head.{k}": v for k, v in load_file(str(src)).items()}
            elif init_head:
                hidden = int(self.hf_config.hidden_size)
                # forked: the global RNG continues as when the head was drawn before mcore's init
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed)
                    lin = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype or par.torch_dtype(self.cfg.dtype))
                    init_value_head(lin)
                head = {"lm_head.weight": lin.weight.detach(), "lm_head.bias": lin.bias.detach()}
            else:
                raise ConfigError("model.path", f"{path} has no {VALUE_HEAD_FILE} for this critic's value head",
                                  "load an HF export of a critic (it writes the head beside the backbone)")
        return TensorSource(ckpt, extra=head, dtype=dtype)

    @staticmethod
    def _expert_layout(ep: int, etp: int) -> Any:
        from megatron.core import parallel_state as mpu

        from areal_cli.engines.megatron.convert import ExpertLayout

        return ExpertLayout(ep_rank=mpu.get_expert_model_parallel_rank(), ep=ep,
                            etp_rank=mpu.get_expert_tensor_parallel_rank(), etp=etp,
                            ep_group=mpu.get_expert_model_parallel_group(),
                            etp_group=mpu.get_expert_tensor_parallel_group())

    def _init_parallel_state(self, tp: int, pp: int, vpp: int, ep: int = 1, etp: int | None = None,
                             peers: Any = ()) -> None:
        """mcore's process groups are process-global: the first engine creates them (a new
        :class:`ParallelState`), later engines of the same process (a reference model, a critic) are given
        their ``peers``, join the peers' state and must ask for the same layout."""
        self.parallel_state = ParallelState.of(peers) or ParallelState()
        self.tp_rank = self.parallel_state.join(self, tp, pp, vpp, ep, etp)

    def _recompute(self, config: Any) -> None:
        if not self.cfg.gradient_checkpointing:
            return
        g = self.cfg.megatron.recompute_granularity
        if g not in RECOMPUTE_GRANULARITIES:
            raise ConfigError("engine.megatron.recompute_granularity", f"unknown granularity {g!r}",
                              "use selective (core attention) or full (whole layers)")
        config.recompute_granularity = g
        if g == "full":
            config.recompute_method, config.recompute_num_layers = "uniform", 1

    def _wrap_ddp(self, chunks: list, config: Any) -> list:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
            use_distributed_optimizer=bool(self.cfg.megatron.use_distributed_optimizer))
        models = [DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=c) for c in chunks]
        # grads sync once, after the last micro-batch: the schedules use these hooks
        config.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        return models

    def _build_mcore_optimizer(self, mixed: bool) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from areal_cli.utils.optim import fuse_adam, lr_factor

        o = self.optim_cfg
        if o.lr <= 0:
            raise ConfigError("algo.optim.lr", f"must be positive, got {o.lr}", "set e.g. algo.optim.lr=1e-5")
        lr_factor(0, kind=o.lr_scheduler, warmup_steps=0, total_steps=1)  # validates the schedule name
        ocfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.beta1, adam_beta2=o.beta2,
            adam_eps=o.eps, bf16=mixed, fp16=False, params_dtype=torch.float32,
            use_distributed_optimizer=bool(self.cfg.megatron.use_distributed_optimizer),
            # clipping happens in _optimizer_step, where a non-finite norm skips the step as under fsdp
            clip_grad=0.0)
        # config_overrides={}: weight decay on every parameter, as the fsdp engine's AdamW (mcore's default
        # skips biases and norms)
        self.optimizer = get_megatron_optimizer(ocfg, list(self.model), config_overrides={})
        # torch's AdamW (no TE/apex here) runs its per-parameter loop, whose temporaries the size of the
        # largest parameter (the embedding) sit on top of the step's state: fused is the same update in place
        fuse_adam(self.optimizer)
        self.scheduler = None
        self._base_lrs = [g.get("lr", o.lr) for g in self.optimizer.param_groups]

    def _gather_coords(self) -> list[_Coord]:
        """Every global rank's place: who holds which tensors, for export and checkpoints."""
        from megatron.core import parallel_state as mpu

        me = _Coord(mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(),
                    mpu.get_data_parallel_rank(), mpu.get_expert_model_parallel_rank(),
                    mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_data_parallel_rank())
        table: list[Any] = [None] * dist.get_world_size()
        collectives.all_gather_object(table, tuple(me))
        return [_Coord(*t) for t in table]

    # ------------------------------------------------------------------ layout
    @property
    def dp_group(self):
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_group()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_rank()

    @property
    def dp_world_size(self) -> int:
        return self.parallel.dp

    @property
    def cp_group(self):
        return None

    @property
    def is_dp_head(self) -> bool:
        c = self._coords[dist.get_rank()]
        return c.pp == 0 and c.tp == 0

    @property
    def _tp_group(self):
        from megatron.core import parallel_state as mpu

        return mpu.get_tensor_model_parallel_group()

    @property
    def _pp_group(self):
        from megatron.core import parallel_state as mpu

        return mpu.get_pipeline_model_parallel_group()

    def _share_batch(self, batch: Batch | None) -> Batch:
        """Every rank of a replica (its tp × pp ranks) works on the head's batch."""
        from megatron.core import parallel_state as mpu

        if self.parallel.tp * self.parallel.pp > 1:
            group = mpu.get_model_parallel_group()
            obj = [None if batch is None else {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                               for k, v in batch.items()}]
            collectives.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
            batch = obj[0]
        if batch is None:
            raise ValueError("train_batch/forward: the data-parallel head must pass a batch")
        return batch

    def _shares_prefix(self, output: str) -> bool:
        return False  # rows are padded, not packed: no shared-prefix layout

    def _split(self, batch: Batch, output: str) -> tuple[list[list[int]], int]:
        """As fsdp's, then padded to a count mcore's schedule accepts: interleaved 1F1B needs a multiple of p."""
        bins, n_mb = super()._split(batch, output)
        if (self.tconfig.virtual_pipeline_model_parallel_size or 1) > 1:
            pp = self.parallel.pp
            n_mb = max(pp, -(-n_mb // pp) * pp)
        return bins, n_mb

    def _logprobs_entropy(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          cutoffs: torch.Tensor | None = None):
        if self.parallel.tp == 1:
            return super()._logprobs_entropy(logits, targets, temperature, cutoffs)
        from areal_cli.engines.archon import vocab_parallel

        return vocab_parallel.logprobs_entropy(logits, targets, temperature, group=self._tp_group,
                                               vocab_size=int(self.mc_arch.vocab_size),
                                               cutoffs=None if cutoffs is None else cutoffs.to(logits.device))

    # ------------------------------------------------------------------ micro-batches through mcore
    def _mb_inputs(self, mb: Batch, shape: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """Right-padded rows (to a multiple of t under sequence parallelism, or to ``shape``) and mcore's mask
        (True = hidden). Padding rows are all padding and carry no loss."""
        ids, am = mb["input_ids"], mb["attention_mask"].bool()
        b, n = ids.shape
        mult = self.parallel.tp if self.sequence_parallel else 1
        B, L = shape or (b, max(mult, -(-n // mult) * mult))
        ids = torch.cat([ids, ids.new_full((b, L - n), self.pad_token_id)], 1)
        am = torch.cat([am, am.new_zeros((b, L - n))], 1)
        ids = torch.cat([ids, ids.new_full((B - b, L), self.pad_token_id)], 0)
        am = torch.cat([am, am.new_zeros((B - b, L))], 0)
        dev = self.device
        return {"input_ids": ids.to(dev), "position_ids": torch.arange(L, device=dev)[None].expand(B, L),
                "mask": (~packing.padded_causal_mask(am)).to(dev), "n": n, "b": b}

    def _step_shape(self, mbs: list[Batch]) -> tuple[int, int] | None:
        """One ``[rows, length]`` for every micro-batch of a step under interleaved 1F1B: its paired
        send/receive calls exchange tensors of different micro-batches, and with varying shapes gloo
        receives the wrong sizes (mcore 0.16.1). None: each micro-batch keeps its own shape."""
        vpp = self.tconfig.virtual_pipeline_model_parallel_size
        if not vpp or vpp == 1:
            return None
        mult = self.parallel.tp if self.sequence_parallel else 1
        n = max(mb["input_ids"].shape[1] for mb in mbs)
        return max(mb["input_ids"].shape[0] for mb in mbs), max(mult, -(-n // mult) * mult)

    def _outputs(self, out: torch.Tensor, mb: Batch, x: dict, output: str, temperature: float):
        """Engine outputs ``[b, n]`` (position convention) from the last stage's ``[b, L, ·]``."""
        n, b = x["n"], x["b"]
        out = out[:b]
        am = mb["attention_mask"].to(self.device).float()
        if output == "values":
            return {"values": packing.shift_padded(out[:, :n, 0].float()) * am}
        ids = x["input_ids"][:b]
        tgt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        cut = mb.get(sampling_mask.KEY)
        if cut is not None:
            cut = sampling_mask.shifted_padded(cut)
            cut = torch.cat([cut, cut.new_full((cut.shape[0], ids.shape[1] - n), float("-inf"))], 1)
        lp, ent = self._logprobs_entropy(out, tgt, temperature, cut)
        return {"logprobs": packing.shift_padded(lp[:, :n]) * am, "entropy": packing.shift_padded(ent[:, :n]) * am}

    def _run_schedule(self, mbs: list[Batch], on_output, forward_only: bool) -> None:
        """Every micro-batch through mcore's schedule; ``on_output(i, last_stage_output)`` → the loss to
        backpropagate (called on the last pipeline stage only)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # process-global in mcore, which picks the schedule from it: engines of one process may differ
        vpp = self.tconfig.virtual_pipeline_model_parallel_size
        mpu.set_virtual_pipeline_model_parallel_world_size(vpp if vpp and vpp > 1 else None)
        shape = self._step_shape(mbs)
        inputs = [self._mb_inputs(mb, shape) for mb in mbs]

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            x = inputs[i]
            self._set_routing(mbs[i], x)
            out = model(x["input_ids"], x["position_ids"], x["mask"])
            return out, lambda o: (on_output(i, o, x), {})

        n = len(mbs)
        chunks = list(self.model)
        its = [iter(range(n)) for _ in chunks] if len(chunks) > 1 else iter(range(n))
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=its, model=chunks, num_microbatches=n,
            seq_length=max(x["input_ids"].shape[1] for x in inputs),
            micro_batch_size=max(x["input_ids"].shape[0] for x in inputs), forward_only=forward_only)
        self._set_routing(None, None)

    def _set_routing(self, mb: Batch | None, x: dict | None) -> None:
        """The routers' replayed experts for the micro-batch about to run (routing replay, MoE models)."""
        if self._routing is None:
            return
        rt = None if mb is None else mb.get(r3.KEY)
        if rt is None:
            self._routing.clear()
            return
        from areal_cli.engines.megatron import FULL_RECOMPUTE

        if self.tconfig.recompute_granularity == "full":
            raise r3.RoutingReplayError(FULL_RECOMPUTE)
        rows, length = x["input_ids"].shape
        sp = self.parallel.tp if self.sequence_parallel else 1
        self._routing.set(rt.cpu(), rows, length, x["b"], x["n"], self.tp_rank if sp > 1 else 0, sp)

    def _accumulate_grads(self, batch, loss_fn, loss_weight_fn, temperature):
        self.model.train()
        batch = self._share_batch(batch)
        output = "values" if self.critic else "logprobs"
        mbs, weights, denom, n_mb = self._weighted_micro_batches(batch, loss_weight_fn, output)
        mbs += [self._dummy_mb() for _ in range(n_mb - len(mbs))]
        weights += [0.0] * (n_mb - len(weights))
        # mcore divides each loss by the micro-batch count, and DDP scales grads by 1/dp: undo both
        undo = float(n_mb * self.parallel.dp)
        # Tensors until the step ends (one host read then): a read per micro-batch stalls the stream.
        scaled_losses: dict[int, torch.Tensor] = {}
        stats: dict[int, dict[str, Any]] = {}

        def on_output(i: int, out: torch.Tensor, x: dict) -> torch.Tensor:
            o = self._outputs(out, {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                                    for k, v in mbs[i].items()}, x, output, temperature)
            if weights[i] == 0.0:
                return sum(v.sum() for v in o.values()) * 0.0
            loss, st = loss_fn(o, mbs[i] | {k: v.to(self.device) for k, v in mbs[i].items()
                                           if isinstance(v, torch.Tensor)})
            scaled = loss * (weights[i] / denom)
            scaled_losses[i], stats[i] = scaled.detach(), st
            return scaled * undo

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(mbs, on_output, forward_only=False)
        acc = step_stats.StepStats.of(scaled_losses.values(), stats, weights)
        loss_sum, stat_sums = self._from_last_stage(acc.totals())
        return loss_sum, stat_sums, denom, n_mb

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` as computed on this replica's last pipeline stage, on every rank of the stage group."""
        if self.parallel.pp == 1:
            return obj
        box = [obj]
        last = dist.get_global_rank(self._pp_group, self.parallel.pp - 1)
        collectives.broadcast_object_list(box, src=last, group=self._pp_group)
        return box[0]

    # ------------------------------------------------------------------ train / forward
    def train_batch(self, batch: Batch | None, loss_fn, loss_weight_fn, temperature: float = 1.0) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_batch on an inference-only engine (constructed with optim_cfg=None)")
        loss_sum, stat_sums, denom, n_mb = self._accumulate_grads(batch, loss_fn, loss_weight_fn, temperature)
        aux = self._moe_aux_loss(n_mb)
        lr = self._set_lr(self.step)
        grad_norm = self._optimizer_step()
        self.step += 1
        stats = self._reduce_stats(loss_sum, stat_sums, denom, grad_norm, lr, n_mb)
        if aux is not None:
            stats["moe_aux_loss"] = aux
        return stats | self._replay_stats()

    def _replay_stats(self) -> dict[str, float]:
        """``routing_replay/mismatch_rate`` of this step over every rank's routers (a stage holds its own
        layers, a sequence-parallel rank its share of the tokens, a data-parallel rank its rows); empty when
        nothing was replayed. Counts held t times over (t without sequence parallelism) leave the rate unchanged."""
        if self._routing is None:
            return {}
        counts = self._routing.take_stats()
        collectives.all_reduce(counts)
        return {"routing_replay/mismatch_rate": float(counts[0] / counts[1])} if counts[1] > 0 else {}

    def _moe_aux_loss(self, n_mb: int) -> float | None:
        """The router's load-balancing loss of this step (before its coefficient), averaged over the MoE
        layers, the micro-batches and the data-parallel ranks; mcore adds ``coeff ×`` it to the gradients."""
        if not self.mc_arch.num_experts or self.cfg.megatron.moe_aux_loss_coeff <= 0:
            return None
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        per_layer = torch.zeros(self.mc_arch.num_layers, dtype=torch.float64)
        if entry is not None:
            per_layer += entry["values"].detach().cpu().double()
        clear_aux_losses_tracker()
        if self.parallel.pp > 1:  # each stage holds its own layers' entries
            collectives.all_reduce(per_layer, group=self._pp_group)
        return float(self._all_reduce(per_layer.sum().reshape(1)).item()) / (
            self.mc_arch.num_layers * max(1, n_mb) * self.parallel.dp)

    def _set_lr(self, step: int) -> float:
        from areal_cli.utils.optim import lr_factor

        o = self.optim_cfg
        f = lr_factor(step, kind=o.lr_scheduler, warmup_steps=o.warmup_steps, total_steps=max(1, self.total_steps),
                      min_lr_ratio=o.min_lr_ratio)
        for g, base in zip(self.optimizer.param_groups, self._base_lrs):
            g["lr"] = base * f
        return o.lr * f

    def _optimizer_step(self) -> float:
        """Clip and step as fsdp does: mcore's grad norm (TP-sharded parameters counted once, summed over the
        stages); a non-finite norm skips the step. The gradients are scaled in place, as apex's multi-tensor
        scale does (mcore's fallback without apex, ``clip_grad_by_total_norm_fp32``, makes a scaled copy of
        each first: grad_memory.py)."""
        opt = self.optimizer
        opt.prepare_grads()
        norm = float(opt.get_grad_norm())  # over every optimizer of a chain (dense and expert parameters)
        if torch.isfinite(torch.tensor(norm)):
            coef = self.optim_cfg.grad_clip / (norm + 1.0e-6)
            if self.optim_cfg.grad_clip > 0 and coef < 1.0:
                for o in getattr(opt, "chained_optimizers", None) or [opt]:
                    attr = "decoupled_grad" if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 else "grad"
                    grads = [g for g in (getattr(p, attr, None) for p in o.get_parameters()) if g is not None]
                    if grads:
                        torch._foreach_mul_(grads, coef)
            opt.step_with_ready_grads()
        opt.zero_grad()
        for m in self.model:
            m.zero_grad_buffer()
        return norm

    def warm_up(self, **_: Any) -> None:
        """A forward/backward through the schedule with a zero loss, then the gradients dropped: lazy
        allocations (grad buffers, p2p shapes) happen while the first rollout is generated. No optimizer
        step, so weights and optimizer state are untouched."""
        if self.optimizer is None:
            return
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(self.mc_arch.vocab_size), (4, 16), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                 "loss_mask": torch.ones_like(ids, dtype=torch.float32)}

        def zero_loss(out, mb):
            return sum(v.sum() for v in out.values()) * 0.0, {}

        self._accumulate_grads(batch if self.is_dp_head else None, zero_loss, lambda mb: 1.0, 1.0)
        self.optimizer.zero_grad()
        for m in self.model:
            m.zero_grad_buffer()

    @torch.no_grad()
    def forward(self, batch: Batch | None, output: str = "logprobs", temperature: float = 1.0):
        keys = self._check_output(output)
        was_training = self.model.training
        self.model.eval()
        batch = self._share_batch(batch)
        bins, n_mb = self._split(batch, output)
        mbs = [packing.select_rows(batch, b) for b in bins]
        mbs += [self._dummy_mb() for _ in range(n_mb - len(mbs))]
        results: dict[int, dict[str, torch.Tensor]] = {}

        def on_output(i: int, out: torch.Tensor, x: dict) -> torch.Tensor:
            mb = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mbs[i].items()}
            results[i] = {k: v.float().cpu() for k, v in self._outputs(out, mb, x, output, temperature).items()}
            return out.new_zeros(())

        self._run_schedule(mbs, on_output, forward_only=True)
        res = self._place_rows(batch, bins, self._from_last_stage(results), keys)
        self.model.train(was_training)
        return res

    # ------------------------------------------------------------------ full weights
    def _named_full_tensors(self, include_value_head: bool = True, to_cpu: bool = True):
        """``(HF name, full tensor)`` on global rank 0, ``(name, None)`` elsewhere, one tensor at a time, in the
        same order on every rank. Only data-parallel replica 0 of a tensor's holders gathers it (a dense tensor
        over TP inside its stage; an expert's over expert TP, one expert at a time, on its ep rank) and copies it
        to the host, and its first rank sends it to rank 0; the other replicas take no part in that tensor."""
        from areal_cli.engines.megatron import convert

        me = self._coords[dist.get_rank()]
        parts = convert.hf_tensors(self.chunks, self.mc_arch, self._tp_group, self.parallel.tp, self.experts)
        mine = [(p.name, p.expert_owner) for p in parts]
        table: list[Any] = [None] * self.parallel.pp
        if self.parallel.pp > 1:
            collectives.all_gather_object(table, mine, group=self._pp_group)
        else:
            table = [mine]
        dense = {c.pp: r for r, c in reversed(list(enumerate(self._coords))) if c.tp == 0 and c.dp == 0}
        expert = {(c.pp, c.ep): r for r, c in reversed(list(enumerate(self._coords))) if c.etp == 0 and c.edp == 0}
        rank, rank0 = dist.get_rank(), dist.get_rank() == 0
        for stage, names in enumerate(table):
            for j, (name, ep_owner) in enumerate(names):
                if self.critic and name.startswith("lm_head.") and not include_value_head:
                    continue
                if ep_owner is None:
                    gathers, owner = me.pp == stage and me.dp == 0, dense[stage]
                else:
                    gathers = me.pp == stage and me.ep == ep_owner and me.edp == 0
                    owner = expert[(stage, ep_owner)]
                full = parts[j].fn().detach().cpu() if gathers else None  # a collective over (expert) tp
                if rank == owner or rank0:
                    full = send_to_rank0(full, owner)
                yield name, (full if rank0 else None)

    def _load_hf(self, path: str) -> None:
        """An HF dir into the running engine, each rank reading only its slices (as ``initialize``)."""
        from areal_cli.engines.megatron import convert

        src = self._hf_source(path, dtype=None)  # as stored: load_state_dict casts to the parameters' dtype
        with torch.no_grad():
            convert.load_hf(self.chunks, src, self.mc_arch, self.tp_rank, self.parallel.tp, self.experts)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()  # fp32 master copies follow the new weights
            if self.tconfig.bf16:
                masters.restore(self, path)  # ... at the checkpoint's precision, not the bf16 copies'

    # ------------------------------------------------------------------ checkpoints
    def _inner_optimizers(self) -> list:
        opts = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [o.optimizer for o in opts]

    def _layout(self) -> dict[str, int]:
        p = self.parallel
        return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp or p.tp,
                "vpp": int(self.cfg.megatron.virtual_stages),
                "distributed_optimizer": int(bool(self.cfg.megatron.use_distributed_optimizer))}

    def _position(self) -> tuple[_Coord, dict[str, int], bool]:
        """This rank's model-parallel position (every rank there holds the same chunks and, without the
        distributed optimizer, the same optimizer state), its model file's name fields, and whether this rank
        writes that file (the position's first rank: data-parallel replica 0)."""
        me = self._coords[dist.get_rank()]
        key = {"pp": me.pp, "tp": me.tp, "ep": me.ep, "etp": me.etp}
        same = [r for r, c in enumerate(self._coords) if (c.pp, c.tp, c.ep, c.etp) == (me.pp, me.tp, me.ep, me.etp)]
        return me, key, dist.get_rank() == min(same)

    def _optim_state(self) -> dict[str, Any]:
        inner = self._inner_optimizers()
        # master weights (fp32 copies under bf16, shards under the distributed optimizer)
        return {"optim": [o.state_dict() for o in inner],
                "main_params": [[p.detach().clone() for g in o.param_groups for p in g["params"]] for o in inner]}

    def save(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format != "dcp":
            return super().save(meta)
        root = Path(meta.path)
        root.mkdir(parents=True, exist_ok=True)
        collectives.barrier()
        _, key, writes_model = self._position()
        sharded_optim = bool(self.cfg.megatron.use_distributed_optimizer)
        own: dict[str, Any] = {"layout": self._layout(), "step": self.step, "version": self._version,
                               "extra_state": meta.extra_state}
        model: dict[str, Any] | None = None
        if writes_model:
            model = {"layout": self._layout(), "chunks": [{k: v for k, v in c.state_dict().items()
                                                           if isinstance(v, torch.Tensor)} for c in self.chunks]}
        if self.optimizer is not None:
            # a distributed optimizer's shard differs per data-parallel rank; otherwise the state is replicated
            # over the replicas and goes once, with the model chunks
            if sharded_optim:
                own.update(self._optim_state())
            elif model is not None:
                model.update(self._optim_state())
        torch.save(own, root / CKPT_FILE.format(rank=dist.get_rank()))
        if model is not None:
            torch.save(model, root / MODEL_FILE.format(**key))
        collectives.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format != "dcp":
            return super().load(meta)
        f = Path(meta.path) / CKPT_FILE.format(rank=dist.get_rank())
        if not f.is_file():
            raise ConfigError("recover.path", f"{meta.path} has no {f.name}",
                              "point at a dir written by the megatron engine with the same number of processes")
        state = torch.load(f, weights_only=False)
        if state["layout"] != self._layout():
            raise ConfigError("allocation_mode.spec", f"the checkpoint was written at {state['layout']}, this run is "
                              f"{self._layout()}", "resume with the same layout, or start a new run from an HF "
                              "export (weight_format=hf), which loads into any layout")
        model = state  # a checkpoint written one whole file per rank (before model files) holds its chunks
        if "chunks" not in state:
            mf = Path(meta.path) / MODEL_FILE.format(**self._position()[1])
            if not mf.is_file():
                raise ConfigError("recover.path", f"{meta.path} has no {mf.name} (written by this position's first "
                                  "data-parallel rank)", "point at a complete megatron checkpoint dir")
            model = torch.load(mf, weights_only=False)
        with torch.no_grad():
            for c, sd in zip(self.chunks, model["chunks"], strict=True):
                missing, unexpected = c.load_state_dict(sd, strict=False)
                if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
                    raise RuntimeError(f"megatron checkpoint mismatch: missing {missing}, unexpected {unexpected}")
            if self.optimizer is not None:
                opt = state if "optim" in state else model
                for o, osd, mains in zip(self._inner_optimizers(), opt["optim"], opt["main_params"], strict=True):
                    o.load_state_dict(osd)
                    params = [p for g in o.param_groups for p in g["params"]]
                    for p, saved in zip(params, mains, strict=True):
                        p.copy_(saved)
        self.step, self._version = state["step"], state["version"]
        meta.extra_state.update(state.get("extra_state") or {})

    def destroy(self) -> None:
        """The last megatron engine of the process takes mcore's parallel state with it, so a later engine
        may run another layout."""
        super().destroy()
        state = getattr(self, "parallel_state", None)
        if state is not None:
            state.leave(self)
