"""What the HF-module backends share: engines that train the Hugging Face module tree itself (FSDP, Archon,
DeepSpeed), as opposed to Megatron, which converts it into megatron-core chunks.

:class:`HFModelEngine` adds to :class:`~areal_cli.engines.base.EngineBase`:

- the model built on the meta device and loaded shard by shard after the backend has parallelised it
  (:mod:`areal_cli.engines.materialize`): :meth:`_build_meta_model` then :meth:`_materialise`;
- the forward over the HF module (packed, padded or shared-prefix micro-batches, logprobs/entropy in fp32,
  a critic's value head in the LM head's place);
- the torch optimizer and schedule, the accumulate / clip / step loop and ``warm_up``;
- the per-parameter full-tensor stream (``DTensor.full_tensor`` one parameter at a time) and
  torch.distributed.checkpoint state (DCP) for ``weight_format="dcp"``.

A backend on it writes ``initialize`` (its mesh and parallelisation between :meth:`_build_meta_model` and
:meth:`_materialise`) and overrides what differs (DeepSpeed: its step, gathers and checkpoint; Archon: the
pipeline path, vocab-parallel logprobs, expert streams).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch, LossFn, LossWeightFn
from areal_cli.api.io_struct import SaveLoadMeta
from areal_cli.engines import (lora as lora_mod, materialize, packing, parallelize as par, precision,
                               routing_replay as r3, sampling_mask, step_stats, ulysses, vision)
from areal_cli.weight_sync.adapter_files import ADAPTER_NAME
from areal_cli.config.engine import GRAD_REDUCE_MODES
from areal_cli.engines.attn_impl import FLASH
from areal_cli.engines.base import VALUE_HEAD_FILE, EngineBase, init_value_head
from areal_cli.errors import ConfigError
from areal_cli.utils import collectives, host_memory
from areal_cli.utils.optim import foreach_ok


class HFModelEngine(EngineBase):
    """Training of an HF causal LM's own module tree (the shared half of fsdp, archon and deepspeed)."""

    # A tied table kept row-sharded (fsdp, engines/sharded_vocab.py): the model's head then returns its input
    # and ``_logprobs_entropy`` makes the logits a vocabulary slice at a time across ranks.
    _table = None

    # ------------------------------------------------------------------ materialisation
    def _build_meta_model(self, model_path: str):
        """The HF model with meta parameters (value head attached for a critic, LoRA injected), the
        Ulysses-aware attention registered, the head in fp32 (:mod:`.precision`; ``self.precision`` is set).
        Returns ``(model, parameter dtype)``; nothing of the checkpoint is read
        yet. Parameters that are not in the checkpoint get their initial values here, on the host."""
        if self.cfg.grad_reduce not in GRAD_REDUCE_MODES:
            raise ConfigError("engine.grad_reduce", f"unknown mode {self.cfg.grad_reduce!r}",
                              f"use one of: {', '.join(GRAD_REDUCE_MODES)}")
        cfg = self._read_model_meta(model_path)
        attn = ulysses.register(self.cfg.attn_impl, self.device)
        self.precision = precision.resolve(self.cfg.dtype, trainable=self.optim_cfg is not None)
        dtype = self.precision.params  # fp32 masters when trained: the backend casts for compute
        torch.manual_seed(self.seed)
        self._vl = vision.is_vl_config(cfg)
        if self._vl:
            attn = vision.attn_impls(attn, self.cfg.attn_impl)
        model = materialize.meta_model(cfg, dtype, attn)
        if self._vl:
            if getattr(self, "freeze_vision_tower", False):
                vision.freeze_tower(model)
        if self.critic:
            self._attach_value_head(model, model_path, dtype)
        elif lora_mod.enabled(self.lora_cfg):
            self.peft_config = lora_mod.inject(model, self.lora_cfg)
            materialize.materialise_lora(model, ADAPTER_NAME, self.peft_config.init_lora_weights)
        precision.fp32_head(model.lm_head)
        self._host_state = materialize.host_state(model)
        return model, dtype

    def _materialise(self, modules: list) -> None:
        """Allocate the parallelised modules' local shards on the device and load them from the model dir."""
        fresh, buffers = self._host_state
        materialize.load_sharded(modules, self._checkpoint(self.model_path), fresh, buffers, device=self.device)
        self._host_state = None
        for m in modules:  # after parallelisation: the hook sees the embedding's output as the decoder does
            vision.install(m)
        host_memory.release()  # the full tensors read for row-wise TP shards, freed under the kept ones

    def _build_optimizer(self, params) -> None:
        if self.optim_cfg is not None:
            from areal_cli.utils.optim import build_optimizer

            # Frozen parameters (the base under LoRA) get no optimizer state.
            params = [p for p in params if p.requires_grad]
            self.optimizer, self.scheduler = build_optimizer(params, self.optim_cfg, self.total_steps)
        elif self.model is not None:
            self.model.eval()

    def _attach_value_head(self, model, model_path: str, dtype) -> None:
        hidden = vision.text_config(model.config).hidden_size
        head = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype)
        src = Path(model_path) / VALUE_HEAD_FILE
        if src.is_file():
            from safetensors.torch import load_file

            head.load_state_dict({k: v.to(dtype) for k, v in load_file(str(src)).items()})
        else:
            init_value_head(head)
        # The tie is broken on purpose: the embedding stays, the vocab projection goes.
        model.config.tie_word_embeddings = False
        model.lm_head = head

    def _logprobs_entropy(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          cutoffs: torch.Tensor | None = None):
        if self._table is None:
            return super()._logprobs_entropy(logits, targets, temperature, cutoffs)
        # the head returned its input: the logits are made a vocabulary slice at a time, across ranks
        return self._table.logprobs_entropy(logits, targets, temperature, cutoffs)

    def _shares_prefix(self, output: str) -> bool:
        # flash-attn takes no mask, and the shared prefix needs one: plain packing then (validate-config says so)
        return (self.cfg.shared_prefix and self.cfg.padding_free and self.parallel.cp == 1
                and self.cfg.pad_to_multiple_of <= 1 and output == "logprobs" and self.cfg.attn_impl != FLASH)

    # ------------------------------------------------------------------ model forward
    def _forward_mb(self, mb: Batch, output: str, temperature: float,
                    loss_only: bool = False) -> dict[str, torch.Tensor]:
        """Outputs for one micro-batch, shaped ``[b, l]`` like ``mb["input_ids"]``.

        ``loss_only``: logprobs and entropy only where ``loss_mask`` is set (zeros elsewhere). The
        vocabulary projection then runs on those positions alone, as TRL's ``logits_to_keep`` does:
        prompt positions are most of an RL batch, and with a large vocabulary the ``[T, V]`` logits
        are most of the activation memory. Used by the training path; ``forward()`` keeps every position.
        """
        max_len = mb["input_ids"].shape[1]
        cp = self.parallel.cp
        # The attention function reads the group from the model's context (ulysses.AttnContext): set per
        # call, as a model's layout is fixed but the context is bound to modules lazily.
        ulysses.set_ulysses_group(self.model, self.cp_group if cp > 1 else None)
        vl = getattr(self, "_vl", False)  # a VL model runs its tower in every forward: no shared-prefix path
        if self._shares_prefix(output) and not vl and r3.prefix_shareable(mb):
            sp = packing.pack_shared(mb, loss_only=loss_only)
            if sp is not None:
                return self._forward_shared(sp, mb, temperature)
        if self.cfg.padding_free or self._seq_multiple() > 1:
            mult = max(1, self.cfg.pad_to_multiple_of) * self._seq_multiple()
            pk = packing.pack(mb, pad_to_multiple_of=mult, pad_token_id=self.pad_token_id)
            if self.cfg.attn_impl == FLASH or ulysses.varlen_is_cheaper(pk.lengths, pk.input_ids.shape[1]):
                ulysses.set_varlen(self.model, pk.lengths, device=self.device)
                mask = None
            else:
                ulysses.set_varlen(self.model, None)
                mask = packing.packed_causal_mask(pk.seq_ids.to(self.device))
            group = self.cp_group if cp > 1 else None
            ids = ulysses.slice_for_rank(pk.input_ids, group, dim=1).to(self.device)
            pos = pk.position_ids
            if vl:
                if vision.has_images(mb):
                    pos = vision.packed_positions(self.model, mb, pk.lengths, pk.input_ids.shape[1])
                vision.set_pending(self.model, mb, packed_total=pk.input_ids.shape[1],
                                   offset=0 if group is None else dist.get_rank(group) * ids.shape[1])
            pos = ulysses.slice_for_rank(pos, group, dim=-1).to(self.device)
            keep = packing.loss_positions(mb, pk) if loss_only and cp == 1 and output == "logprobs" else None
            keep = keep.to(self.device) if keep is not None and keep.numel() > 0 else None
            r3.set_replay(self.model, r3.packed(mb, pk.lengths, pk.input_ids.shape[1], group))
            # A 4-D mask goes to every layer as it is. (A {"full_attention": …} mapping only reaches models
            # whose forward reads one: Qwen3-MoE's builds its own mask, gets None for the engine's attention
            # function, and a packed row would attend across its sequences.)
            try:
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                                    logits_to_keep=keep if keep is not None else 0, attention_mask=mask).logits[0]
            finally:
                if vl:
                    vision.set_pending(self.model, None)
            if output == "values":
                vals = ulysses.gather_seq(logits[:, 0].float(), group)
                return {"values": packing.unpack_shifted(vals, pk, max_len)}
            tgt = ulysses.slice_for_rank(packing.next_token_targets(pk), group, dim=0).to(self.device)
            cut = mb.get(sampling_mask.KEY)
            if cut is not None:
                cut = sampling_mask.next_token_values(cut, pk.lengths, pk.input_ids.shape[1])
                cut = ulysses.slice_for_rank(cut, group, dim=0).to(self.device)
            if keep is None:
                lp, ent = self._logprobs_entropy(logits, tgt, temperature, cut)
            else:  # logits exist at the kept positions only; the rest stay zero
                lp_k, ent_k = self._logprobs_entropy(logits, tgt.index_select(0, keep), temperature,
                                                     None if cut is None else cut.index_select(0, keep))
                lp = lp_k.new_zeros(tgt.shape[0]).index_put((keep,), lp_k)
                ent = ent_k.new_zeros(tgt.shape[0]).index_put((keep,), ent_k)
            lp = packing.unpack_shifted(ulysses.gather_seq(lp, group), pk, max_len)
            ent = packing.unpack_shifted(ulysses.gather_seq(ent, group), pk, max_len)
            return {"logprobs": lp, "entropy": ent}
        ulysses.set_varlen(self.model, None)
        am = mb["attention_mask"].to(self.device)
        ids = mb["input_ids"].to(self.device)
        mask = packing.padded_causal_mask(am)
        pos = torch.arange(max_len, device=self.device)[None].expand_as(ids)
        r3.set_replay(self.model, r3.padded(mb))
        if vl:
            if vision.has_images(mb):
                pos = vision.padded_positions(self.model, mb).to(self.device)
            vision.set_pending(self.model, mb)
        try:
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, attention_mask=mask).logits
        finally:
            if vl:
                vision.set_pending(self.model, None)
        if output == "values":
            return {"values": packing.shift_padded(logits[..., 0].float()) * am}
        tgt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        cut = mb.get(sampling_mask.KEY)
        lp, ent = self._logprobs_entropy(logits, tgt, temperature,
                                         None if cut is None else sampling_mask.shifted_padded(cut))
        return {"logprobs": packing.shift_padded(lp) * am, "entropy": packing.shift_padded(ent) * am}

    def _forward_shared(self, sp: packing.SharedPack, mb: Batch, temperature: float) -> dict[str, torch.Tensor]:
        """Logprobs/entropy of a shared-prefix packed micro-batch (see :func:`packing.pack_shared`)."""
        dev = self.device
        ulysses.set_varlen(self.model, sp.seg_lens, sp.seg_ids, device=dev)
        r3.set_replay(self.model, r3.shared(mb, sp.input_ids))
        logits = self.model(input_ids=sp.input_ids.to(dev), position_ids=sp.position_ids.to(dev), use_cache=False,
                            logits_to_keep=sp.keep.to(dev),
                            attention_mask={"full_attention": None, "sliding_attention": None}).logits[0]
        m = sp.map.to(dev)
        idx = (sp.rows.to(dev), sp.cols.to(dev))
        shape = tuple(mb["input_ids"].shape)
        cut = mb.get(sampling_mask.KEY)
        # One kept set per entry: rows sharing a position may have drawn under different ones. A row-sharded
        # table's head returns hidden states (engines/sharded_vocab.py): repeating them per entry is cheap.
        if cut is not None or self._table is not None:
            lp_e, ent_e = self._logprobs_entropy(logits[m], sp.targets.to(dev), temperature,
                                                 None if cut is None else cut[sp.rows, sp.cols])
            return {"logprobs": lp_e.new_zeros(shape).index_put(idx, lp_e),
                    "entropy": ent_e.new_zeros(shape).index_put(idx, ent_e)}
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        ent_u = -(logp.exp() * logp).sum(-1)
        lp_e = logp[m, sp.targets.to(dev)]
        return {"logprobs": lp_e.new_zeros(shape).index_put(idx, lp_e),
                "entropy": ent_u.new_zeros(shape).index_put(idx, ent_u[m])}

    # ------------------------------------------------------------------ train / forward
    def train_batch(self, batch: Batch | None, loss_fn: LossFn, loss_weight_fn: LossWeightFn,
                    temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step. ``temperature`` scales logits before the logprobs (must match rollout)."""
        if self.optimizer is None:
            raise RuntimeError("train_batch on an inference-only engine (constructed with optim_cfg=None)")
        loss_sum, stat_sums, denom, n_mb = self._accumulate_grads(batch, loss_fn, loss_weight_fn, temperature)
        grad_norm = self._clip_grads()
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        self._zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        return self._reduce_stats(loss_sum, stat_sums, denom, grad_norm, lr, n_mb)

    def _accumulate_grads(self, batch, loss_fn, loss_weight_fn, temperature):
        """Forward/backward every micro-batch; gradients end up summed over ranks (see apply_fsdp)."""
        self.model.train()
        batch = self._share_batch(batch)
        output = "values" if self.critic else "logprobs"
        # The forward packs from the host micro-batch (lengths, packing indices: no device reads); the
        # loss reads the device copy. Losses and stats stay tensors until the step ends (StepStats).
        mbs, weights, denom, n_mb = self._weighted_micro_batches(batch, loss_weight_fn, output)
        acc = step_stats.StepStats()
        for i in range(n_mb):
            self._begin_micro_batch(last=i == n_mb - 1)
            if i < len(mbs):
                out = self._forward_mb(mbs[i], output, temperature, loss_only=True)
                loss, stats = loss_fn(out, self._on_device(mbs[i]))
                scaled = loss * (weights[i] / denom)
                acc.add_loss(scaled)
                acc.add(stats, weights[i])
                # routing replay's mismatch, when replayed
                acc.add_ratio(r3.MISMATCH, r3.replay_counts(self.model), weights[i])
            else:  # this rank ran out of sequences: a zero-weight forward keeps the collectives aligned
                out = self._forward_mb(self._dummy_mb(), output, temperature)
                scaled = sum(v.sum() for v in out.values()) * 0.0
            self._backward(scaled)
        loss_sum, stat_sums = acc.totals()
        return loss_sum, stat_sums, denom, n_mb

    def _on_device(self, mb: Batch) -> Batch:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}

    def _begin_micro_batch(self, last: bool) -> None:
        """Before each micro-batch's forward: FSDP2 reduce-scatters after every micro-batch, or skips it on
        all but the last (``engine.grad_reduce``; see engines/fsdp.py for when each wins)."""
        par.set_grad_sync(self.model, last or self.cfg.grad_reduce == "per_micro_batch")

    def _backward(self, scaled_loss: torch.Tensor) -> None:
        """Backward of a micro-batch loss already scaled by ``weight / global_weight``."""
        scaled_loss.backward()

    def warm_up(self, rows: int = 8, prompt_len: int = 32, completion_len: int = 16, group: int = 4) -> None:
        """A whole training step on a synthetic GRPO-shaped batch that changes nothing: zero loss,
        learning rate 0, optimizer state and gradients dropped after (a restored optimizer is not
        stepped, so a resumed run keeps Adam's moments), RNG untouched. The first real
        step otherwise also pays one-time setup (FSDP's lazy init, DTensor sharding propagation for
        every optimizer and clipping op: ~0.45 s, three steady steps of the embedded default); the
        RL trainer runs this while the servers generate the first batch. Collective on every rank."""
        if self.optimizer is None:
            return
        g = torch.Generator().manual_seed(0)
        vocab = int(vision.text_config(self.hf_config).vocab_size)
        prompts = torch.randint(0, vocab, (max(1, rows // group), prompt_len), generator=g)
        ids = torch.cat([prompts.repeat_interleave(group, dim=0)[:rows],
                         torch.randint(0, vocab, (rows, completion_len), generator=g)], dim=1)
        loss_mask = torch.zeros_like(ids, dtype=torch.float32)
        loss_mask[:, prompt_len:] = 1.0
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "loss_mask": loss_mask}
        if not self.is_dp_head:
            batch = None

        def zero_loss(out, mb):
            return sum(v.sum() for v in out.values()) * 0.0, {}

        self._accumulate_grads(batch, zero_loss, lambda mb: 1.0, 1.0)
        self._clip_grads()
        if not self.optimizer.state:  # a restored optimizer (resume) keeps its moments: no step then
            lrs = [pg["lr"] for pg in self.optimizer.param_groups]
            for pg in self.optimizer.param_groups:
                pg["lr"] = 0.0  # zero gradients and lr 0: every parameter stays bit-identical
            self.optimizer.step()
            for pg, lr in zip(self.optimizer.param_groups, lrs):
                pg["lr"] = lr
            self.optimizer.state.clear()  # the first real step starts Adam's moments and step count afresh
        self._zero_grad()

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        # one multi-tensor kernel per dtype/device group where the gradients allow it (see foreach_ok)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, foreach=foreach_ok(params))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    @torch.no_grad()
    def forward(self, batch: Batch | None, output: str = "logprobs", temperature: float = 1.0) -> dict[str, torch.Tensor]:
        keys = self._check_output(output)
        was_training = self.model.training
        self.model.eval()
        batch = self._share_batch(batch)
        bins, n_mb = self._split(batch, output)
        results = {}
        for i in range(n_mb):
            if i < len(bins):
                out = self._forward_mb(packing.select_rows(batch, bins[i]), output, temperature)
                results[i] = {k: out[k].float().cpu() for k in keys}
            else:
                self._forward_mb(self._dummy_mb(), output, temperature)
        self.model.train(was_training)
        return self._place_rows(batch, bins, results, keys)

    # ------------------------------------------------------------------ full weights
    def _named_full_tensors(self, include_value_head: bool = True, to_cpu: bool = True, keep=None):
        """Yield ``(name, full_tensor)`` on global rank 0 and ``(name, None)`` elsewhere, in the
        same order on every rank (gathering a shard is a collective). Tied weights appear once.
        ``keep(name)``: only those names (the LoRA adapter alone, without gathering the base)."""
        seen: set[int] = set()
        src = dist.get_rank() == 0
        # The adapter is parameters only: walking them skips building the whole model's state dict
        # (~1200 module visits on the 59M benchmark model, a quarter of an adapter push).
        items = self.model.named_parameters() if keep is not None else self.model.state_dict().items()
        for name, p in items:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if self.critic and name.startswith("lm_head.") and not include_value_head:
                continue
            if keep is not None and not keep(name):
                continue
            if getattr(self, "_vl", False):  # the hub checkpoint's names (visual.*, model.*), as the model dir's
                for n, t in self._stream_tensor(name, p, to_cpu, src):
                    yield vision.hub_name(n), t
            else:
                yield from self._stream_tensor(name, p, to_cpu, src)

    def _stream_tensor(self, name: str, p: torch.Tensor, to_cpu: bool, src: bool):
        """One parameter's full tensor for :meth:`_named_full_tensors` (a collective); an engine may
        stream one parameter as several (archon: fused experts, one expert at a time)."""
        full = _full(p)
        yield name, ((full.detach().cpu() if to_cpu else full.detach()) if src else None)

    def _save_dcp(self, meta: SaveLoadMeta) -> None:
        import torch.distributed.checkpoint as dcp

        Path(meta.path).mkdir(parents=True, exist_ok=True)
        collectives.barrier()
        state = self._dcp_state()
        dcp.save(state, checkpoint_id=meta.path)
        extra = {"step": self.step, "version": self._version,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 # DCP's flattened optimizer state can drop a group's float hyperparameters (lr, betas,
                 # eps) on a rank whose parameters differ from rank 0's (pipeline stages): keep them here.
                 "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in self.optimizer.param_groups] if self.optimizer else None,
                 "optim_extra": self._optim_extra(),
                 "extra_state": meta.extra_state}
        torch.save(extra, Path(meta.path) / f"extra_rank{dist.get_rank()}.pt")
        collectives.barrier()

    def _load_dcp(self, meta: SaveLoadMeta) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        extra_file = Path(meta.path) / f"extra_rank{dist.get_rank()}.pt"
        if not extra_file.is_file():
            raise ConfigError("recover.path", f"{meta.path} has no {extra_file.name}",
                              "point at a dir written by save(weight_format='dcp') with the same world size")
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=meta.path)
        # strict=False under LoRA: the frozen base is not in the checkpoint (it is the model dir's).
        opts = StateDictOptions(strict=self.peft_config is None)
        if self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state["model"], options=opts)
        extra = torch.load(extra_file, weights_only=False)
        if self.optimizer is not None and extra.get("param_groups"):
            for group, saved in zip(self.optimizer.param_groups, extra["param_groups"], strict=True):
                group.update(saved)
        if self.optimizer is not None:
            self._restore_optim_extra(extra.get("optim_extra"))
        self.step = extra["step"]
        self._version = extra["version"]
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        meta.extra_state.update(extra.get("extra_state") or {})

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optim_extra(self) -> Any:
        """Optimizer state this rank keeps outside ``self.optimizer`` (archon: a pipelined tied table's rows),
        saved in its own checkpoint file."""
        return None

    def _restore_optim_extra(self, state: Any) -> None:
        """Put back what :meth:`_optim_extra` saved (``None`` for a checkpoint without it)."""

    def _load_hf(self, path: str) -> None:
        """An HF dir's weights into the trained model, each rank reading its own shards (a LoRA adapter
        keeps its values: an HF dir holds the base)."""
        materialize.load_sharded(self._hf_modules(), self._checkpoint(path), {}, {},
                                 names=lambda n: not lora_mod.is_lora_name(n))

    def _hf_modules(self) -> list:
        """The modules whose parameter names are the HF ones (the model; archon: its pipeline stages)."""
        return [self.model]

    def _dcp_state(self) -> dict[str, Any]:
        """Model (and optimizer) state for DCP; under LoRA the adapter only: the base never changes."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is not None:
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        if self.peft_config is not None:
            state["model"] = {k: v for k, v in state["model"].items() if lora_mod.is_lora_name(k)}
        return state


def _full(p: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a (possibly sharded) parameter. On a one-rank mesh the local shard is
    already the whole tensor: skip the gather collective and its fresh allocation."""
    if not hasattr(p, "full_tensor"):
        return p
    if p.device_mesh.size() == 1:
        local = p.to_local()
        if local.shape == p.shape:
            return local
    return p.full_tensor()
