"""FSDP2 training engine: ``fully_shard`` over a ``(dp, cp)`` mesh, Ulysses for ``cp``.

Runs the same code on CPU (gloo) and CUDA (nccl). Batch format, position convention and loss
normalisation are defined in :mod:`areal_cli.api.engine_api`. Data layout across ranks:

- ``train_batch``/``forward`` take the *rank-local* batch of this data-parallel replica (use
  :func:`areal_cli.engines.packing.split_batch_for_dp` to cut a global batch). Inside a Ulysses group
  only the head (``is_dp_head``) needs to pass a batch; the others may pass ``None``.
- Every rank returns the same stats; ``forward`` returns outputs for the replica's batch.

Critic (``critic=True``): the LM head is replaced by a ``Linear(hidden, 1)`` value head.
``values[i]`` is the value of the state *before* token ``i`` (the head applied to the hidden state
of token ``i-1``), matching the position convention. HF export writes the backbone to
``model.safetensors`` and the head to ``value_head.safetensors`` (keys ``weight``, ``bias``);
initializing a critic from a dir that has ``value_head.safetensors`` restores it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch, LossFn, LossWeightFn, TrainEngine
from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta, WeightUpdateMeta
from areal_cli.engines import lora as lora_mod
from areal_cli.engines import packing, sampling_mask, ulysses
from areal_cli.engines import parallelize as par
from areal_cli.engines import routing_replay as r3
from areal_cli.errors import ConfigError, WeightSyncError

VALUE_HEAD_FILE = "value_head.safetensors"


class FSDPEngine(TrainEngine):
    def __init__(self, engine_cfg, optim_cfg=None, *, total_steps: int = 1, seed: int = 0,
                 critic: bool = False, lora: Any = None):
        """``lora``: ``model.lora`` (rank > 0 trains a peft adapter on the frozen model; engines/lora.py)."""
        self.cfg = engine_cfg
        self.lora_cfg = lora
        self.peft_config = None
        self.optim_cfg = optim_cfg
        self.total_steps = total_steps
        self.seed = seed
        self.critic = critic
        self.model = None
        self.optimizer = None
        self.scheduler = None
        self.step = 0
        self._version = 0
        self._meshes: par.Meshes | None = None
        self._senders: dict[str, Any] = {}
        self._runner = None
        self._last_sender = None
        self.model_path = ""
        self.pad_token_id = 0

    # ------------------------------------------------------------------ setup
    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        from transformers import AutoConfig

        from areal_cli.utils.dist import default_device, init_distributed

        init_distributed()
        self.device = torch.device(kwargs.get("device") or os.environ.get("AREAL_DEVICE") or default_device())
        self.parallel = parallel
        self.model_path = model_path
        if not (Path(model_path) / "config.json").is_file():
            raise ConfigError("model.path", f"{model_path} is not an HF model dir (no config.json)",
                              "point model.path at a local dir with config.json and safetensors")
        self._meshes = par.build_meshes(parallel, self.device.type)
        ulysses.set_ulysses_group(self._meshes.cp_group if parallel.cp > 1 else None)
        if parallel.cp > 1:
            hf_cfg = AutoConfig.from_pretrained(model_path)
            if hf_cfg.num_attention_heads % parallel.cp:
                raise ConfigError("allocation_mode", f"c{parallel.cp} does not divide num_attention_heads="
                                  f"{hf_cfg.num_attention_heads}", "pick c that divides the head count")
        model, dtype = self._load_hf_model(model_path)
        model.to(self.device)
        if self.cfg.gradient_checkpointing:
            par.enable_gradient_checkpointing(model)
        mp = self.cfg.mixed_precision and dtype == torch.float32
        # One rank (dp x cp == 1) has nothing to shard: as torchtitan, leave the module plain. FSDP's
        # hooks and DTensor dispatch cost ~15% of a step of the embedded default for no effect.
        # Mixed precision on one rank is autocast around the forward: the fp32 weights stay the module's
        # and its matmuls run in bf16 (AMX on CPU: 1.06 TFLOP/s against fp32's 0.16 for a [1000, 256] x
        # [256, 1024] matmul on one core here), while FSDP's policy would cast every parameter every step.
        if self._meshes.fsdp_mesh.size() > 1:
            par.apply_fsdp(model, self._meshes.fsdp_mesh, param_dtype=torch.bfloat16 if mp else None,
                           reduce_dtype=torch.float32 if mp else None)
        elif mp:
            model.forward = torch.autocast(self.device.type, dtype=torch.bfloat16)(model.forward)
        self.model = model
        self._build_optimizer(model.parameters())
        self.hf_config = model.config

    def _load_hf_model(self, model_path: str):
        """The HF causal LM on CPU in ``engine.dtype`` (value head attached for a critic), with the
        Ulysses-aware attention registered. Returns ``(model, dtype)``."""
        from transformers import AutoModelForCausalLM

        attn = ulysses.register()
        dtype = par.torch_dtype(self.cfg.dtype)
        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn)
        self.pad_token_id = model.config.pad_token_id or 0
        self.arch = list(model.config.architectures or [type(model).__name__])
        self.generation_config = getattr(model, "generation_config", None)
        if self.critic:
            self._attach_value_head(model, model_path, dtype)
        elif lora_mod.enabled(self.lora_cfg):
            self.peft_config = lora_mod.inject(model, self.lora_cfg)
        return model, dtype

    def _build_optimizer(self, params) -> None:
        if self.optim_cfg is not None:
            from areal_cli.utils.optim import build_optimizer

            # Frozen parameters (the base under LoRA) get no optimizer state.
            params = [p for p in params if p.requires_grad]
            self.optimizer, self.scheduler = build_optimizer(params, self.optim_cfg, self.total_steps)
        elif self.model is not None:
            self.model.eval()

    def _attach_value_head(self, model, model_path: str, dtype) -> None:
        hidden = model.config.hidden_size
        head = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype)
        src = Path(model_path) / VALUE_HEAD_FILE
        if src.is_file():
            from safetensors.torch import load_file

            head.load_state_dict({k: v.to(dtype) for k, v in load_file(str(src)).items()})
        else:
            torch.nn.init.normal_(head.weight, std=1.0 / (hidden + 1) ** 0.5)
            torch.nn.init.zeros_(head.bias)
        # The tie is broken on purpose: the embedding stays, the vocab projection goes.
        model.config.tie_word_embeddings = False
        model.lm_head = head

    # ------------------------------------------------------------------ accessors
    @property
    def dp_group(self):
        return self._meshes.dp_group if self._meshes else None

    @property
    def cp_group(self):
        return self._meshes.cp_group if self._meshes else None

    @property
    def dp_rank(self) -> int:
        return self._meshes.dp_rank if self._meshes else 0

    @property
    def dp_world_size(self) -> int:
        return self.parallel.dp if self._meshes else 1

    @property
    def is_dp_head(self) -> bool:
        return self._meshes is None or self._meshes.cp_rank == 0

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)

    # ------------------------------------------------------------------ micro-batches
    def _share_batch(self, batch: Batch | None) -> Batch:
        """Give every rank of a Ulysses group the head's batch."""
        if self.parallel.cp > 1:
            obj = [None if batch is None else {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                               for k, v in batch.items()}]
            src = dist.get_global_rank(self.cp_group, 0)
            dist.broadcast_object_list(obj, src=src, group=self.cp_group)
            batch = obj[0]
        if batch is None:
            raise ValueError("train_batch/forward: the data-parallel head must pass a batch")
        return batch

    def _seq_multiple(self) -> int:
        """Every packed forward's length is a multiple of this (Ulysses splits the sequence over cp)."""
        return self.parallel.cp

    def _logprobs_entropy(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          cutoffs: torch.Tensor | None = None):
        """``cutoffs``: Keep-Sampling-Mask thresholds aligned with ``targets`` (see engines/sampling_mask.py)."""
        if cutoffs is not None:
            return sampling_mask.masked_logprobs_entropy(logits, targets, temperature, cutoffs.to(logits.device))
        return _logprobs_entropy(logits, targets, temperature)

    def _shares_prefix(self, output: str) -> bool:
        return (self.cfg.shared_prefix and self.cfg.padding_free and self.parallel.cp == 1
                and self.cfg.pad_to_multiple_of <= 1 and output == "logprobs")

    def _split(self, batch: Batch, output: str) -> tuple[list[list[int]], int]:
        lens = packing.seq_lens(batch)
        if self._shares_prefix(output):
            bins = packing.prefix_bins(batch, self.cfg.max_tokens_per_mb)
        else:
            bins = packing.ffd_bins(lens, self.cfg.max_tokens_per_mb)
        n = torch.tensor([len(bins)], dtype=torch.long)
        if self.dp_world_size > 1:
            n = self._all_reduce(n, dist.ReduceOp.MAX)
        n_mb = int(n.item())
        return packing.equalize_bins(bins, lens, n_mb), n_mb

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the data-parallel ranks (a new tensor on ``t``'s device; identity at dp=1):
        the reducer ``PPOActor`` needs for batch-level statistics over sharded batches."""
        return self._all_reduce(t.detach().clone()).to(t.device)

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.dp_world_size == 1:
            return t
        t = t.to(self._comm_device())
        dist.all_reduce(t, op=op, group=self.dp_group)
        return t.cpu()

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _dummy_mb(self) -> Batch:
        # Two tokens: position 1 has an output, so the zero loss is still connected to every parameter
        # (a one-token row has no prediction, its zero loss no graph, and its backward would fail).
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                "loss_mask": torch.zeros_like(ids, dtype=torch.float32)}

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
        # The attention function reads the group from module state; engines sharing a process
        # (actor, reference, critic) may differ, so set it per call.
        ulysses.set_ulysses_group(self.cp_group if cp > 1 else None)
        if self._shares_prefix(output) and r3.prefix_shareable(mb):
            sp = packing.pack_shared(mb, loss_only=loss_only)
            if sp is not None:
                return self._forward_shared(sp, mb, temperature)
        if self.cfg.padding_free or self._seq_multiple() > 1:
            mult = max(1, self.cfg.pad_to_multiple_of) * self._seq_multiple()
            pk = packing.pack(mb, pad_to_multiple_of=mult, pad_token_id=self.pad_token_id)
            if ulysses.varlen_is_cheaper(pk.lengths, pk.input_ids.shape[1]):
                ulysses.set_varlen(pk.lengths)
                mask = None
            else:
                ulysses.set_varlen(None)
                mask = packing.packed_causal_mask(pk.seq_ids).to(self.device)
            group = self.cp_group if cp > 1 else None
            ids = ulysses.slice_for_rank(pk.input_ids, group, dim=1).to(self.device)
            pos = ulysses.slice_for_rank(pk.position_ids, group, dim=1).to(self.device)
            keep = packing.loss_positions(mb, pk) if loss_only and cp == 1 and output == "logprobs" else None
            keep = keep.to(self.device) if keep is not None and keep.numel() > 0 else None
            r3.set_replay(self.model, r3.packed(mb, pk.lengths, pk.input_ids.shape[1], group))
            # A 4-D mask goes to every layer as it is. (A {"full_attention": …} mapping only reaches models
            # whose forward reads one: Qwen3-MoE's builds its own mask, gets None for the engine's attention
            # function, and a packed row would attend across its sequences.)
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                                logits_to_keep=keep if keep is not None else 0, attention_mask=mask).logits[0]
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
        ulysses.set_varlen(None)
        am = mb["attention_mask"].to(self.device)
        ids = mb["input_ids"].to(self.device)
        mask = packing.padded_causal_mask(am)
        pos = torch.arange(max_len, device=self.device)[None].expand_as(ids)
        r3.set_replay(self.model, r3.padded(mb))
        logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, attention_mask=mask).logits
        if output == "values":
            return {"values": packing.shift_padded(logits[..., 0].float()) * am}
        tgt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        cut = mb.get(sampling_mask.KEY)
        lp, ent = self._logprobs_entropy(logits, tgt, temperature,
                                         None if cut is None else sampling_mask.shifted_padded(cut))
        return {"logprobs": packing.shift_padded(lp) * am, "entropy": packing.shift_padded(ent) * am}

    def _forward_shared(self, sp: packing.SharedPack, mb: Batch, temperature: float) -> dict[str, torch.Tensor]:
        """Logprobs/entropy of a shared-prefix packed micro-batch (see :func:`packing.pack_shared`)."""
        ulysses.set_varlen(sp.seg_lens, sp.seg_ids)
        dev = self.device
        r3.set_replay(self.model, r3.shared(mb, sp.input_ids))
        logits = self.model(input_ids=sp.input_ids.to(dev), position_ids=sp.position_ids.to(dev), use_cache=False,
                            logits_to_keep=sp.keep.to(dev),
                            attention_mask={"full_attention": None, "sliding_attention": None}).logits[0]
        m = sp.map.to(dev)
        idx = (sp.rows.to(dev), sp.cols.to(dev))
        shape = tuple(mb["input_ids"].shape)
        cut = mb.get(sampling_mask.KEY)
        if cut is not None:  # one kept set per entry: rows sharing a position may have drawn under different ones
            lp_e, ent_e = self._logprobs_entropy(logits[m], sp.targets.to(dev), temperature, cut[sp.rows, sp.cols])
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
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.step += 1
        return self._reduce_stats(loss_sum, stat_sums, denom, grad_norm, lr, n_mb)

    def _weighted_micro_batches(self, batch: Batch, loss_weight_fn: LossWeightFn, output: str,
                                to_device: bool = False) -> tuple[list[Batch], list[float], float, int]:
        """This replica's micro-batches, the loss weight of each, the global weight (summed over the
        data-parallel ranks; 1 when that is 0) and the step's micro-batch count (the largest over the ranks:
        a rank with fewer pads with zero-weight micro-batches)."""
        bins, n_mb = self._split(batch, output)
        mbs = [packing.select_rows(batch, b) for b in bins]
        if to_device:
            mbs = [{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
                   for mb in mbs]
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        total_w = float(self._all_reduce(torch.tensor([sum(weights)], dtype=torch.float64)).item())
        return mbs, weights, (total_w if total_w > 0 else 1.0), n_mb

    def _accumulate_grads(self, batch, loss_fn, loss_weight_fn, temperature):
        """Forward/backward every micro-batch; gradients end up summed over ranks (see apply_fsdp)."""
        self.model.train()
        batch = self._share_batch(batch)
        output = "values" if self.critic else "logprobs"
        mbs, weights, denom, n_mb = self._weighted_micro_batches(batch, loss_weight_fn, output, to_device=True)
        stat_sums: dict[str, float] = {}
        loss_sum = 0.0
        for i in range(n_mb):
            self._begin_micro_batch(last=i == n_mb - 1)
            if i < len(mbs):
                out = self._forward_mb(mbs[i], output, temperature, loss_only=True)
                loss, stats = loss_fn(out, mbs[i])
                stats = {**stats, **r3.replay_stats(self.model)}  # routing replay's mismatch, when replayed
                scaled = loss * (weights[i] / denom)
                loss_sum += float(scaled.detach())
                for k, v in stats.items():
                    stat_sums[k] = stat_sums.get(k, 0.0) + float(v) * weights[i]
            else:  # this rank ran out of sequences: a zero-weight forward keeps the collectives aligned
                out = self._forward_mb(self._dummy_mb(), output, temperature)
                scaled = sum(v.sum() for v in out.values()) * 0.0
            self._backward(scaled)
        return loss_sum, stat_sums, denom, n_mb

    def _begin_micro_batch(self, last: bool) -> None:
        """Before each micro-batch's forward: reduce gradients across ranks on the last one only."""
        par.set_grad_sync(self.model, last)

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
        vocab = int(self.hf_config.vocab_size)
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
        self.optimizer.zero_grad(set_to_none=True)

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, foreach=False)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _reduce_stats(self, loss_sum, stat_sums, denom, grad_norm, lr, n_mb) -> dict[str, float]:
        keys = sorted(stat_sums)
        if self.dp_world_size > 1:
            all_keys: list = [None] * self.dp_world_size
            dist.all_gather_object(all_keys, keys, group=self.dp_group)
            keys = sorted(set().union(*all_keys))
        vec = torch.tensor([loss_sum] + [stat_sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        vec = self._all_reduce(vec)
        out = {"loss": float(vec[0]), "grad_norm": grad_norm, "lr": float(lr), "n_micro_batches": float(n_mb),
               "loss_weight": float(denom)}
        out.update({k: float(vec[j + 1]) / denom for j, k in enumerate(keys)})
        return out

    def _check_output(self, output: str) -> tuple[str, ...]:
        """The keys ``forward(output=…)`` returns; a clear error for an output this engine cannot give."""
        if output not in ("logprobs", "values"):
            raise ValueError(f"output must be 'logprobs' or 'values', got {output!r}")
        if output == "values" and not self.critic:
            raise ValueError("forward(output='values') needs an engine built with critic=True")
        return ("values",) if output == "values" else ("logprobs", "entropy")

    @staticmethod
    def _place_rows(batch: Batch, bins: list[list[int]], results: dict, keys: tuple[str, ...]) -> dict:
        """Per-micro-batch outputs ``results[i]`` (rows ``bins[i]``, trimmed lengths) back into ``[B, L]``."""
        B, L = batch["input_ids"].shape
        res = {k: torch.zeros(B, L, dtype=torch.float32) for k in keys}
        for i, rows in enumerate(bins):
            idx = torch.tensor(rows)
            for k in keys:
                res[k][idx, : results[i][k].shape[1]] = results[i][k].float()
        return res

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
            yield from self._stream_tensor(name, p, to_cpu, src)

    def _stream_tensor(self, name: str, p: torch.Tensor, to_cpu: bool, src: bool):
        """One parameter's full tensor for :meth:`_named_full_tensors` (a collective); an engine may
        stream one parameter as several (archon: fused experts, one expert at a time)."""
        full = _full(p)
        yield name, ((full.detach().cpu() if to_cpu else full.detach()) if src else None)

    def _write_hf(self, path: str, tensors: dict) -> None:
        from areal_cli.weight_sync.hf_io import write_hf_dir

        head = {}
        if self.critic:
            head = {k.split(".", 1)[1]: tensors.pop(k) for k in list(tensors) if k.startswith("lm_head.")}
        cfg = self.hf_config
        if self.critic:
            cfg = cfg.__class__.from_dict(cfg.to_dict())
            cfg.tie_word_embeddings = _orig_tie(self.model_path)
        write_hf_dir(path, tensors, cfg, architectures=self.arch, tokenizer_src=self.model_path,
                     generation_config=self.generation_config, dtype=par.torch_dtype(self.cfg.dtype))
        if head:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in head.items()}, str(Path(path) / VALUE_HEAD_FILE))

    # ------------------------------------------------------------------ checkpoints
    def _export_tensors(self, to_cpu: bool = True):
        """The model as HF tensors: under LoRA with the adapter merged into the base weights."""
        named = self._named_full_tensors(to_cpu=to_cpu)
        return lora_mod.merged_stream(named, self.peft_config) if self.peft_config is not None else named

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's full tensors on global rank 0 (``{}`` elsewhere); collective."""
        return {n: t for n, t in self._named_full_tensors(keep=lora_mod.is_lora_name) if t is not None}

    def save(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format == "hf":
            tensors = {n: t for n, t in self._export_tensors() if t is not None}
            adapter = self.adapter_tensors() if self.peft_config is not None else {}
            if dist.get_rank() == 0:
                self._write_hf(meta.path, tensors)
                if meta.tokenizer_path:
                    from areal_cli.weight_sync.hf_io import copy_tokenizer

                    copy_tokenizer(meta.tokenizer_path, meta.path)
                if adapter:  # beside the merged model: the adapter alone, in peft's layout
                    lora_mod.write_adapter_dir(Path(meta.path) / lora_mod.ADAPTER_SUBDIR, adapter,
                                               self.peft_config)
            dist.barrier()
        elif meta.weight_format == "dcp":
            self._save_dcp(meta)
        else:
            raise ConfigError("save.weight_format", f"unknown format {meta.weight_format!r}", "use hf or dcp")

    def _save_dcp(self, meta: SaveLoadMeta) -> None:
        import torch.distributed.checkpoint as dcp

        Path(meta.path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = self._dcp_state()
        dcp.save(state, checkpoint_id=meta.path)
        extra = {"step": self.step, "version": self._version,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 # DCP's flattened optimizer state can drop a group's float hyperparameters (lr, betas,
                 # eps) on a rank whose parameters differ from rank 0's (pipeline stages): keep them here.
                 "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in self.optimizer.param_groups] if self.optimizer else None,
                 "extra_state": meta.extra_state}
        torch.save(extra, Path(meta.path) / f"extra_rank{dist.get_rank()}.pt")
        dist.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        """``dcp``: restore model, optimizer, scheduler, step and version; the saved
        ``extra_state`` is merged into ``meta.extra_state``. ``hf``: load full weights only."""
        if meta.weight_format == "hf":
            self._load_hf(meta.path)
            return
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
        self.step = extra["step"]
        self._version = extra["version"]
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        meta.extra_state.update(extra.get("extra_state") or {})

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

    def _read_hf(self, path: str, untie: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor of an HF dir (a critic's value head as ``lm_head.*``); ``untie``: a tied model's
        head is the embedding, under its own name too (what a module tree with both names wants)."""
        from safetensors.torch import load_file

        full: dict[str, torch.Tensor] = {}
        for f in sorted(Path(path).glob("model*.safetensors")):
            full.update(load_file(str(f)))
        if self.critic and (Path(path) / VALUE_HEAD_FILE).is_file():
            full.update({f"lm_head.{k}": v for k, v in load_file(str(Path(path) / VALUE_HEAD_FILE)).items()})
        if untie and "lm_head.weight" not in full and "model.embed_tokens.weight" in full and not self.critic:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        return full

    def _load_hf(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = self._read_hf(path)
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, meta: WeightUpdateMeta, engines: list, loop=None) -> None:
        """Push weights to ``engines`` (pause → sync → continue) and set the version on both sides.

        The pushed version is ``meta.version`` when it is > 0, else ``get_version() + 1``. Only global
        rank 0 talks to servers; every trainer rank must call this (gathering shards is collective).
        ``loop``: the event loop that owns the clients (default: a private one). Under LoRA only the
        adapter is pushed (weight_sync/lora.py); the servers keep the base weights.
        """
        if self.critic:
            raise WeightSyncError("weight sync: a critic engine has no policy weights to push")
        if meta.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("weight_sync.backend", "nccl needs CUDA but this trainer has no GPU",
                              "use backend=gloo on CPU hosts")
        version = meta.version if meta.version > 0 else self._version + 1
        self._sync_weights(dataclasses.replace(meta, version=version), engines, loop)

    def push_adapter(self, meta: WeightUpdateMeta, engines: list, loop=None) -> None:
        """Under LoRA: load the current adapter into ``engines`` at exactly ``meta.version`` (0 included),
        for start-up, resume and restarted servers, which hold the base weights and no adapter yet."""
        if self.peft_config is None:
            raise WeightSyncError("push_adapter: this engine trains no LoRA adapter (model.lora.rank=0)")
        self._sync_weights(meta, engines, loop)

    def _sync_weights(self, meta: WeightUpdateMeta, engines: list, loop=None) -> None:
        from areal_cli.utils.concurrency import LoopRunner
        from areal_cli.weight_sync.senders import DiskSender, DistributedSender

        version = meta.version
        n_servers = sum(len(getattr(c, "addresses", [])) for c in engines) or len(engines)
        meta = dataclasses.replace(meta, version=version, world_size=meta.world_size or 1 + n_servers)
        is_src = dist.get_rank() == 0
        if is_src and self._runner is None:
            self._runner = LoopRunner(loop)
        err: WeightSyncError | None = None
        if self.peft_config is not None:  # the servers keep the base: only the adapter moves
            from areal_cli.weight_sync.lora import AdapterSender

            sender = self._senders.setdefault("lora", AdapterSender(self._runner))
            err = sender.send(meta, engines, self.adapter_tensors(), self.peft_config, is_src=is_src)
        elif meta.type == "disk":
            sender = self._senders.setdefault("disk", DiskSender(self._runner))
            err = sender.send(meta, engines, self._named_full_tensors(), is_src=is_src, write_dir=self._write_hf)
        elif meta.type == "distributed":
            # NCCL broadcasts from the GPU; gloo from host memory.
            on_gpu = meta.backend == "nccl" and self.device.type == "cuda"
            sender = self._senders.setdefault("distributed", DistributedSender(self._runner))
            sender.device = str(self.device) if on_gpu else "cpu"
            err = sender.send(meta, engines, self._named_full_tensors(to_cpu=not on_gpu), is_src=is_src)
        else:
            raise ConfigError("weight_sync.type", f"unknown type {meta.type!r}", "use disk or distributed")
        self._last_sender = sender
        msg = [str(err) if err is not None else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(msg, src=0)
        if msg[0] is not None:
            raise err if err is not None else WeightSyncError(msg[0])
        self._version = version
        for c in engines:
            c.set_version(version)

    @property
    def last_sync_seconds(self) -> dict[str, float]:
        """Phase timings of the last weight sync on rank 0 (for benchmarks and logs)."""
        return dict(self._last_sender.last_seconds) if self._last_sender is not None else {}

    def destroy(self) -> None:
        for s in self._senders.values():
            if hasattr(s, "close"):
                s.close()
        self._senders.clear()
        if self._runner is not None:
            self._runner.close()
            self._runner = None


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


def _logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Per-position log p(target) and entropy of ``softmax(logits / temperature)`` in fp32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _orig_tie(model_path: str) -> bool:
    import json

    try:
        return bool(json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False
