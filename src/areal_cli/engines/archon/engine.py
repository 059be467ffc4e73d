"""The Archon engine: FSDP2 × DTensor TP × pipelining × Ulysses CP on the plain HF module tree.

Parallelism is applied from outside (torchtitan style, see the sibling modules): one ``(pp, dp, cp,
tp)`` mesh, the family's TP plan, activation checkpointing, FSDP2 over ``dp×cp``, and with ``p > 1``
the model cut into pipeline stages driven by a fresh ``torch.distributed.pipelining`` schedule each
step. Parameter names stay HF names on every rank, so HF export, weight sync and checkpoints need no
key mapping.

What it shares with the other HF-module backends (:class:`~areal_cli.engines.hf_model.HFModelEngine`:
sharded materialisation, micro-batching, the global loss normalisation, optimizer and schedules, DCP
checkpoints, the weight-sync senders) it inherits; it
overrides the mesh, the forward (vocab-parallel logprobs, the pipeline path), gradient clipping over
several meshes and stages, and the full-tensor stream (gathered over TP, sent from the stage that owns
each tensor). MoE models (Qwen3-MoE) run their experts through :mod:`.expert_parallel`, cut over the
``e`` ranks when the allocation has ``e``; the experts stream out in the checkpoint's per-expert names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch
from areal_cli.api.io_struct import ParallelStrategy
from areal_cli.engines import packing, sampling_mask, sharded_vocab, step_stats, ulysses, vision
from areal_cli.engines import parallelize as fsdp_par
from areal_cli.engines import routing_replay as r3
from areal_cli.engines.archon import SPEC, clip, expert_parallel, pipeline, vocab_parallel
from areal_cli.engines.archon.mesh import ArchonMesh, ArchonDims
from areal_cli.engines.archon.parallelize import parallelize
from areal_cli.engines.hf_model import HFModelEngine, _full
from areal_cli.errors import ConfigError
from areal_cli.utils import collectives
from areal_cli.utils.dist import send_to_rank0


class ArchonEngine(HFModelEngine):
    """PyTorch-native 4-D parallel training of HF decoder models (Qwen2/2.5, Qwen3, Llama)."""

    dims = SPEC.dims  # its spec (engines/archon/__init__.py) is the one place that says them

    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        from transformers import AutoConfig

        from areal_cli.utils.dist import default_device, init_distributed

        init_distributed()
        self.device = torch.device(kwargs.get("device") or default_device())
        self.parallel, self.model_path = parallel, model_path
        self._aux_values: list[torch.Tensor] = []  # this step's load-balancing losses (one per layer and mb)
        self._aux_total = 1.0  # (replica, micro-batch, Ulysses slice) count they are averaged over
        self._dummy: Batch | None = None
        self._check_model_dir(model_path)
        dims = ArchonDims.from_strategy(parallel)
        hf_cfg = AutoConfig.from_pretrained(model_path)
        dims.check_model(vision.text_config(hf_cfg))
        if vision.is_vl_config(hf_cfg) and dims.pp > 1:
            raise ConfigError("allocation_mode", f"archon does not cut a vision-language model into pipeline "
                              f"stages (p{dims.pp}): its tower runs inside the first stage's embedding",
                              "drop p from the archon dims (d, c and t run vision models)")
        self.freeze_vision_tower = bool(kwargs.get("freeze_vision_tower", False))
        self._check_moe(hf_cfg, dims)
        self.mesh: ArchonMesh = dims.build(self.device.type)
        m = self.mesh
        self._meshes = fsdp_par.Meshes(mesh=m.world, fsdp_mesh=m.fsdp_mesh, dp_group=m.dp_group,
                                       cp_group=m.cp_group, dp_rank=m.dp_rank, cp_rank=m.cp_rank)
        model, _ = self._build_meta_model(model_path)  # meta parameters: nothing read yet
        self.hf_config = model.config
        mp = self.precision.mixed  # bf16 compute over fp32 masters (engines/precision.py)
        self._table = self._sharded_table(model, dims, self.precision.compute if mp else None)
        opts = dict(activation_checkpointing=self.cfg.gradient_checkpointing, vocab_parallel=not self.critic,
                    param_dtype=self.precision.compute if mp else None, reduce_dtype=torch.float32 if mp else None)
        self.pipe: pipeline.Pipeline | None = None
        if dims.pp > 1:
            a = self.cfg.archon
            stages = pipeline.build_stage_modules(
                model, pp_rank=m.pp_rank, pp_size=dims.pp, schedule=a.pp_schedule,
                virtual_stages=a.pp_virtual_stages, layers_per_stage=list(a.pp_layers) or None)
            for s in stages:
                parallelize(s, m, pipelined=True, **opts)
            self._materialise(stages)  # each rank reads its own shards
            self.pipe = pipeline.Pipeline(stages, m, a.pp_schedule, self.device)
            self.model = torch.nn.ModuleDict({f"stage{s.stage_index}": s for s in stages})
        else:
            self.model = parallelize(model, m, table=self._table, **opts)
            self._materialise([self.model])  # each rank reads its own shards
        self.moe = expert_parallel.moe_blocks(self.model)
        # a tied table held by the first and the last stage: each keeps half of its rows' moments (tied_rows.py)
        tied = self.pipe.tied_rows() if self.pipe is not None and self.optim_cfg is not None else None
        self._build_optimizer(p for p in self.model.parameters() if tied is None or p is not tied.param)
        self._tied_rows = tied
        if tied is not None:
            tied.attach(self.optimizer)

    def _optim_extra(self) -> Any:
        return None if self._tied_rows is None else {"tied_rows": self._tied_rows.state_dict()}

    def _restore_optim_extra(self, state: Any) -> None:
        if self._tied_rows is not None:
            self._tied_rows.load_state_dict((state or {}).get("tied_rows"), self.optimizer)

    def _zero_grad(self) -> None:
        super()._zero_grad()
        if self._tied_rows is not None:  # outside the optimizer; a skipped step leaves its gradient
            self._tied_rows.param.grad = None

    def _sharded_table(self, model, dims: ArchonDims, compute) -> sharded_vocab.ShardedTable | None:
        """The tied table row-sharded over all d x c x t ranks (``engine.tied_head``, engines/sharded_vocab.py),
        or None: FSDP2 gathers it over d x c, and t splits it as a vocab-parallel embedding and head."""
        refuse = None
        if dims.pp > 1:
            refuse = "archon's pipeline stages hold the embedding and the head apart"
        elif expert_parallel.is_moe_config(model.config):
            refuse = "archon shards a MoE model's tied table with its experts' meshes"
        n = dims.dp * dims.cp * dims.tp
        if not sharded_vocab.wanted(self.cfg.tied_head, self.cfg.max_tokens_per_mb, model, n, refuse):
            return None
        mesh = self.mesh.world["dp", "cp", "tp"]._flatten("dp_cp_tp")
        return sharded_vocab.install(model, mesh, compute, seq_mesh=self.mesh.tp_mesh if dims.tp > 1 else None)

    def _check_moe(self, hf_cfg: Any, dims: ArchonDims) -> None:
        coeff = float(self.cfg.archon.moe_aux_loss_coeff)
        if coeff > 0 and not expert_parallel.is_moe_config(hf_cfg):
            raise ConfigError("engine.archon.moe_aux_loss_coeff",
                              f"{coeff} is set but the model has no experts",
                              "set engine.archon.moe_aux_loss_coeff=0 for a dense model")
        if coeff > 0 and dims.pp > 1:
            raise ConfigError("engine.archon.moe_aux_loss_coeff",
                              f"the load-balancing loss does not run under pipelining yet (p{dims.pp})",
                              "drop p from the archon dims, or set engine.archon.moe_aux_loss_coeff=0")
        if expert_parallel.is_moe_config(hf_cfg) and type(hf_cfg).__name__ != "Qwen3MoeConfig":
            raise ConfigError("model.path", f"archon runs MoE models of the family "
                              f"{expert_parallel.SUPPORTED}, got model_type={hf_cfg.model_type!r}",
                              "use a Qwen3-MoE model, or engine=megatron")

    # ------------------------------------------------------------------ MoE load-balancing loss
    def _weighted_micro_batches(self, batch, loss_weight_fn, output, to_device=False):
        mbs, weights, denom, n_mb = super()._weighted_micro_batches(batch, loss_weight_fn, output, to_device)
        self._aux_values = []
        coeff = float(self.cfg.archon.moe_aux_loss_coeff) if self.moe else 0.0
        if coeff > 0:  # mcore's weighting: the mean over every (replica, micro-batch) of each layer's loss
            n = self._all_reduce(torch.tensor([float(len(mbs))], dtype=torch.float64))
            self._aux_total = float(n.item()) * self.parallel.cp  # each Ulysses slice counts on its own
            for b in self.moe:
                b.aux_scale, b.aux_record = coeff / self._aux_total, self._aux_values.append
        return mbs, weights, denom, n_mb

    def _dummy_mb(self) -> Batch:
        self._dummy = super()._dummy_mb()  # a padding micro-batch: no load-balancing loss of its own
        return self._dummy

    def _forward_mb(self, mb: Batch, output: str, temperature: float, loss_only: bool = False):
        coeff = float(self.cfg.archon.moe_aux_loss_coeff) if self.moe else 0.0
        if coeff > 0 and self.model.training:
            for b in self.moe:
                b.aux_scale = 0.0 if mb is self._dummy else coeff / self._aux_total
        return super()._forward_mb(mb, output, temperature, loss_only)

    def train_batch(self, batch, loss_fn, loss_weight_fn, temperature: float = 1.0) -> dict[str, float]:
        stats = super().train_batch(batch, loss_fn, loss_weight_fn, temperature)
        if self.moe and float(self.cfg.archon.moe_aux_loss_coeff) > 0:
            # before its coefficient, averaged over layers, micro-batches and dp ranks (as megatron)
            host = step_stats.read_floats(self._aux_values)  # one host read for every layer and micro-batch
            total = torch.tensor([sum(host[id(v)] for v in self._aux_values)], dtype=torch.float64)
            if self.parallel.cp > 1:
                collectives.all_reduce(total, group=self.cp_group)
            total = self._all_reduce(total)
            stats["moe_aux_loss"] = float(total.item()) / (len(self.moe) * self._aux_total)
            for b in self.moe:
                b.aux_scale, b.aux_record = 0.0, None
        return stats

    # ------------------------------------------------------------------ layout
    @property
    def is_dp_head(self) -> bool:
        return self.mesh.is_dp_head

    def _share_batch(self, batch: Batch | None) -> Batch:
        """Every rank of a replica (pp×cp×tp) works on the head's batch."""
        if self.mesh.replica_mesh.size() > 1:
            obj = [None if batch is None else {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                               for k, v in batch.items()}]
            collectives.broadcast_object_list(obj, src=self.mesh.dp_head_rank, group=self.mesh.replica_group)
            batch = obj[0]
        if batch is None:
            raise ValueError("train_batch/forward: the data-parallel head must pass a batch")
        return batch

    def _seq_multiple(self) -> int:
        # Ulysses cuts the sequence over cp, sequence parallelism over tp.
        return self.parallel.cp * self.parallel.tp

    def _shares_prefix(self, output: str) -> bool:
        return self.parallel.tp == 1 and super()._shares_prefix(output)

    def _logprobs_entropy(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          cutoffs: torch.Tensor | None = None):
        if self._table is not None or self.parallel.tp == 1 or self.critic:  # a row-sharded table: the base's
            return super()._logprobs_entropy(logits, targets, temperature, cutoffs)
        return vocab_parallel.logprobs_entropy(logits, targets, temperature, group=self.mesh.tp_group,
                                               vocab_size=int(vision.text_config(self.hf_config).vocab_size),
                                               cutoffs=None if cutoffs is None else cutoffs.to(logits.device))

    def _clip_grads(self) -> float:
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        if self.pipe is not None:
            return clip.clip_grad_norm_(self.pipe.parameters(), max_norm, pp_group=self.mesh.pp_group,
                                        norm_parameters=self.pipe.norm_parameters())
        return clip.clip_grad_norm_(list(self.model.parameters()), max_norm)

    # ------------------------------------------------------------------ pipeline path
    def _accumulate_grads(self, batch, loss_fn, loss_weight_fn, temperature):
        if self.pipe is None:
            return super()._accumulate_grads(batch, loss_fn, loss_weight_fn, temperature)
        self.model.train()
        batch = self._share_batch(batch)
        output = "values" if self.critic else "logprobs"
        mbs, weights, denom, n_mb = self._weighted_micro_batches(batch, loss_weight_fn, output)
        n_sched = pipeline.valid_microbatch_count(self.pipe.schedule, self.parallel.pp, n_mb)
        mbs += [self._dummy_mb() for _ in range(n_sched - len(mbs))]
        weights += [0.0] * (n_sched - len(weights))
        inputs = self._pipeline_inputs(mbs)

        def mb_loss(logits: torch.Tensor, i: int):
            out = self._unpack_outputs(logits, inputs, i, output, temperature)
            if weights[i] == 0.0:
                return sum(v.sum() for v in out.values()) * 0.0, {}
            return loss_fn(out, {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                                 for k, v in mbs[i].items()})

        loss = pipeline.MicroBatchLoss(mb_loss, weights, denom)
        self.pipe.train_step(inputs["input_ids"], n_microbatches=n_sched, loss=loss,
                             position_ids=inputs["position_ids"], attention_mask=inputs["mask"])
        # one host read for the step's losses and stats, in schedule order
        acc = step_stats.StepStats.of(loss.scaled_loss_tensors.values(), loss.stats, weights)
        loss_sum, stat_sums = self._from_last_stage(acc.totals())
        return loss_sum, stat_sums, denom, n_mb

    def _pipeline_inputs(self, mbs: list[Batch]) -> dict[str, Any]:
        """Each micro-batch packed into one row, padded to a common length (a multiple of cp·tp).

        The block-diagonal masks are explicit arguments of every stage's forward, so no module-global
        attention state has to survive from a micro-batch's forward to its backward or its recompute
        (several run in between under a pipeline schedule). Under Ulysses each rank takes its slice
        of the tokens and positions; the mask stays whole, as the attention gathers the sequence.
        """
        if any(r3.KEY in mb for mb in mbs):  # the validator refuses this plan; a direct caller is told too
            raise r3.RoutingReplayError("archon's pipeline path (p>1) does not replay routing: drop p, or "
                                        "train without the batch's routed_experts")
        mult = max(1, self.cfg.pad_to_multiple_of) * self._seq_multiple()
        packs = [packing.pack(mb, pad_to_multiple_of=mult, pad_token_id=self.pad_token_id) for mb in mbs]
        # bucketed, not the step's own longest: a new length would rebuild the schedule (see bucket_length)
        length = pipeline.bucket_length(max(p.input_ids.shape[1] for p in packs), mult,
                                        cap=self.cfg.max_tokens_per_mb)
        cp_group = self.cp_group if self.parallel.cp > 1 else None
        ulysses.set_ulysses_group(self.model, cp_group)
        ulysses.set_varlen(self.model, None)
        dev = self.device
        ids = pipeline.pad_stack([p.input_ids for p in packs], length=length, value=self.pad_token_id)
        pos = pipeline.pad_stack([p.position_ids for p in packs], length=length)
        return {
            "packs": packs, "mbs": mbs, "length": length, "cp_group": cp_group,
            "input_ids": ulysses.slice_for_rank(ids, cp_group, dim=1).to(dev),
            "position_ids": ulysses.slice_for_rank(pos, cp_group, dim=1).to(dev),
            # built on the device, once per step: every stage's layers read it from there
            "mask": pipeline.pad_stack_masks([packing.packed_causal_mask(p.seq_ids.to(dev)) for p in packs],
                                             length=length),
        }

    def _unpack_outputs(self, logits: torch.Tensor, inputs: dict, i: int, output: str,
                        temperature: float) -> dict[str, torch.Tensor]:
        pk, mb, group = inputs["packs"][i], inputs["mbs"][i], inputs["cp_group"]
        T, L = pk.input_ids.shape[1], inputs["length"]
        max_len = mb["input_ids"].shape[1]
        logits = logits[0]  # this rank's slice of the padded row under Ulysses: [L / cp, ...]
        if output == "values":
            vals = ulysses.gather_seq(logits[:, 0].float(), group)[:T]
            return {"values": packing.unpack_shifted(vals, pk, max_len)}
        tgt = packing.next_token_targets(pk)
        tgt = torch.cat([tgt, tgt.new_zeros(L - T)]) if L > T else tgt
        cut = mb.get(sampling_mask.KEY)
        if cut is not None:  # Keep-Sampling-Mask thresholds in the same packed, padded, sliced layout
            cut = sampling_mask.next_token_values(cut, pk.lengths, L)
            cut = ulysses.slice_for_rank(cut, group, dim=0).to(self.device)
        lp, ent = self._logprobs_entropy(logits, ulysses.slice_for_rank(tgt, group, dim=0).to(self.device),
                                         temperature, cut)
        lp, ent = ulysses.gather_seq(lp, group)[:T], ulysses.gather_seq(ent, group)[:T]
        return {"logprobs": packing.unpack_shifted(lp, pk, max_len),
                "entropy": packing.unpack_shifted(ent, pk, max_len)}

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` as computed on this replica's last pipeline stage, on every rank of the stage group."""
        box = [obj]
        last = dist.get_global_rank(self.mesh.pp_group, self.parallel.pp - 1)
        collectives.broadcast_object_list(box, src=last, group=self.mesh.pp_group)
        return box[0]

    @torch.no_grad()
    def forward(self, batch: Batch | None, output: str = "logprobs", temperature: float = 1.0):
        if self.pipe is None:
            return super().forward(batch, output, temperature)
        self._check_output(output)
        was_training = self.model.training
        self.model.eval()
        batch = self._share_batch(batch)
        bins, n_mb = self._split(batch, output)
        mbs = [packing.select_rows(batch, b) for b in bins]
        n_sched = pipeline.valid_microbatch_count(self.pipe.schedule, self.parallel.pp, n_mb)
        mbs += [self._dummy_mb() for _ in range(n_sched - len(mbs))]
        inputs = self._pipeline_inputs(mbs)
        results: dict[int, dict[str, torch.Tensor]] = {}

        def out_fn(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            i = int(index.reshape(-1)[0])  # the schedule hands each micro-batch its row of `targets`
            results[i] = {k: v.cpu() for k, v in self._unpack_outputs(logits, inputs, i, output, temperature).items()}
            return logits.new_zeros(1)

        self.pipe.forward(inputs["input_ids"], n_microbatches=n_sched, output_fn=out_fn,
                          position_ids=inputs["position_ids"], attention_mask=inputs["mask"],
                          targets=torch.arange(n_sched, device=self.device).view(n_sched, 1))
        res = self._place_rows(batch, bins, self._from_last_stage(results), self._check_output(output))
        self.model.train(was_training)
        return res

    # ------------------------------------------------------------------ full weights
    def _named_full_tensors(self, include_value_head: bool = True, to_cpu: bool = True, keep=None):
        """``(HF name, full tensor)`` on global rank 0, ``(name, None)`` elsewhere, one tensor at a time:
        each is gathered over its stage's FSDP×TP mesh and sent from the stage that owns it, so no rank
        holds more than one full tensor beyond its own shards. Tied weights appear once."""
        if self.pipe is None:
            yield from super()._named_full_tensors(include_value_head, to_cpu, keep)
            return
        mine = [(n, p) for s in self.model.values() for n, p in s.named_parameters()
                if not (s.tied_copy and n == "lm_head.weight") and (keep is None or keep(n))]
        table: list[Any] = [None] * self.parallel.pp
        collectives.all_gather_object(table, [n for n, _ in mine], group=self.mesh.pp_group)
        src_rank0 = dist.get_rank() == 0
        head_of = [dist.get_global_rank(self.mesh.pp_group, r) for r in range(self.parallel.pp)]
        for stage_rank, stage_names in enumerate(table):
            for j, name in enumerate(stage_names):
                if self.critic and name.startswith("lm_head.") and not include_value_head:
                    continue
                if _is_expert(name):
                    owned = mine[j][1] if self.mesh.pp_rank == stage_rank else None
                    yield from self._expert_tensors(name, owned, stage_rank)
                    continue
                full = None
                if self.mesh.pp_rank == stage_rank:  # a collective over this stage's FSDP×TP mesh
                    full = _full(mine[j][1]).detach().cpu()
                if self.mesh.is_stage_head or src_rank0:
                    full = send_to_rank0(full, head_of[stage_rank])
                yield name, (full if src_rank0 else None)

    def _stream_tensor(self, name: str, p: torch.Tensor, to_cpu: bool, src: bool):
        """The FSDP engine's stream, with each layer's experts streamed one expert at a time."""
        if self.moe and _is_expert(name):
            yield from self._expert_tensors(name, p, 0)
        else:
            yield from super()._stream_tensor(name, p, to_cpu, src)

    def _expert_tensors(self, name: str, p: torch.Tensor | None, stage: int):
        """One fused expert tensor (``experts.gate_up_proj [E, 2I, H]`` or ``experts.down_proj``) as the
        checkpoint's per-expert tensors, one expert at a time: the expert-parallel shard is gathered over
        the ``efsdp`` ranks of ``stage`` (collective there; ``p`` None elsewhere), then expert ``j`` goes
        point to point from the ``ep`` rank that holds it (at ``efsdp`` 0) to global rank 0. No rank holds
        more than its own ``E/e`` experts of this tensor, and rank 0 one expert beyond that."""
        E, ep = int(self.hf_config.num_experts), max(1, self.parallel.ep)
        n_local = E // ep
        local = None if p is None else _ep_local(p).detach().cpu()
        owners = [int(r) for r in self.mesh.world.mesh[stage].flatten().tolist()]  # dp_cp order (t is 1)
        me = dist.get_rank()
        for j in range(E):
            owner = owners[j // n_local] if ep > 1 else owners[0]
            t = local[j % n_local] if (local is not None and me == owner) else None
            if me in (0, owner):
                t = send_to_rank0(t, owner)
            for piece_name, piece in expert_parallel.per_expert_names(name, t, expert=j):
                yield piece_name, (piece.clone() if me == 0 else None)

    def _hf_modules(self) -> list:
        return list(self.model.values()) if self.pipe is not None else [self.model]


def _is_expert(name: str) -> bool:
    return name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj")


def _ep_local(p: torch.Tensor) -> torch.Tensor:
    """This rank's expert-parallel shard ``[E/e, ...]`` of an expert tensor: a 2-D ``(efsdp, ep)`` DTensor
    is gathered over efsdp first; a 1-D one (ep, or FSDP alone at e=1) is its full tensor over that mesh."""
    if not hasattr(p, "to_local"):
        return p
    from torch.distributed.tensor import Replicate, Shard

    mesh = p.device_mesh
    if mesh.ndim == 2:
        return p.redistribute(mesh, [Replicate(), Shard(0)]).to_local()
    if mesh.mesh_dim_names == ("ep",):
        return p.to_local()
    return _full(p)
