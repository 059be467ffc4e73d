"""The DeepSpeed engine: ZeRO stages 0-3 over the d × c ranks (Ulysses for c, as fsdp), on CPU (gloo)
and CUDA (nccl).

Under ZeRO-3 the HF model is built from its config inside ``deepspeed.zero.Init``, so a rank holds only
its partition of each parameter from construction on; the weights are then loaded bucket by bucket,
each bucket gathered while global rank 0 alone reads its tensors from the checkpoint. ZeRO-0/1/2 keep
the weights whole on every rank by design: the model is allocated uninitialised and read into tensor by
tensor. The model goes to ``deepspeed.initialize`` with the project's own torch AdamW and LR schedule
(DeepSpeed's fused/CPU Adam kernels are C++ built at run time, which a CPU host without a toolchain
cannot do, and the torch optimizer keeps the schedules and numerics of the other engines).
Micro-batching, the loss normalisation, the HF forward, logprobs, the streamed HF export and the weight-sync
senders come from the shared bases (:class:`~areal_cli.engines.hf_model.HFModelEngine`); what differs is how a
step runs and how full weights are reached:

- DeepSpeed averages gradients over the data-parallel ranks and divides each backward by its
  accumulation steps. The engine's losses are already normalised by the global loss weight, so every
  backward runs with ``scale_wrt_gas=False`` and the loss multiplied by the dp size.
- The number of micro-batches changes from step to step: the config fixes one accumulation step and
  the engine marks the last micro-batch as the boundary itself. Ranks with fewer micro-batches run
  zero-weight forwards (ZeRO-3 gathers parameters in every forward, a collective).
- Gradient clipping is DeepSpeed's (``gradient_clipping``), over the partitioned gradients; its norm
  is the reported ``grad_norm``.
- Full weights (HF export, weight sync) are gathered bucket by bucket with
  ``deepspeed.zero.GatheredParameters`` (a collective on every rank) and only rank 0 copies them; the
  HF export streams them into safetensors shards. With bf16 compute over fp32 weights the fp32 master
  copies are gathered instead; after ``deepspeed.initialize`` (which builds them from the bf16 module)
  each rank puts its masters back from the checkpoint, reading under ZeRO-3 only its partitions' rows.
- ``weight_format="dcp"`` checkpoints are DeepSpeed's own ``save_checkpoint``/``load_checkpoint``
  (module, ZeRO partitions of the optimizer) plus a per-rank file with the step, version and LR schedule;
  they resume bit-exact on the same number of ranks.
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import ExitStack
from math import inf
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch, LossFn, LossWeightFn
from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
from areal_cli.engines import ulysses
from areal_cli.engines import lora as lora_mod
from areal_cli.engines import materialize, precision, sharded_vocab, zero3_table
from areal_cli.engines import parallelize as par
from areal_cli.engines.base import VALUE_HEAD_FILE
from areal_cli.engines.hf_model import HFModelEngine
from areal_cli.engines.specs import DEEPSPEED, check_deepspeed_knobs
from areal_cli.errors import ConfigError
from areal_cli.utils import collectives, host_memory

CHECKPOINT_TAG = "state"


def import_deepspeed():
    """``deepspeed``, imported for this host: the CPU accelerator without CUDA, and never a run-time
    C++ build (its shared-memory all-reduce op serves only DeepSpeed's inference kernels)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as e:
        raise ConfigError("engine.name", f"engine=deepspeed needs the deepspeed package ({e})",
                          "install it: pip install --no-build-isolation 'areal-cli[deepspeed]' "
                          "(scripts/install_test_deps.sh does it with the CPU torch kept)") from None
    # Without this, the first TorchBackend compiles deepspeed_shm_comm with the system compiler (~35 s).
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    return deepspeed


def _buckets(named, limit: int):
    """``(name, parameter)`` pairs in lists of about ``limit`` elements (a ZeRO-3 parameter counts its
    full size, ``ds_numel``)."""
    bucket: list = []
    size = 0
    for name, p in named:
        n = int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += n
    if bucket:
        yield bucket


def _mismatch(named, src, path: str) -> ConfigError | None:
    """Why the dir cannot fill ``named`` (a missing tensor or another shape), or None."""
    missing = [n for n, _ in named if n not in src]
    if missing:
        return ConfigError("model.path", f"{path} lacks {len(missing)} parameters of the model "
                           f"(e.g. {missing[0]})", "load an HF dir of this architecture (an export of it)")
    for name, p in named:
        want = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        if tuple(src.shape(name)) != want:
            return ConfigError("model.path", f"{path}: {name} has shape {src.shape(name)}, the model's is "
                               f"{want}", "load an HF dir of this architecture (an export of it)")
    return None


def _copy_from_rank0(named, reader, path: str, zero3: bool, limit: int) -> set[str]:
    """Checkpoint tensors into ``named`` parameters, bucket by bucket, read by global rank 0 alone (its
    ``reader``; None elsewhere). Under ZeRO-3 each bucket is gathered (``modifier_rank=0``) and its exit
    re-partitions rank 0's values to every rank; replicated (ZeRO-0/1/2) parameters are broadcast from
    rank 0. Collective. Returns the names loaded."""
    from deepspeed.runtime.zero import GatheredParameters

    # Rank 0 alone sees the dir: every rank raises its verdict together rather than hang in a gather.
    e = _mismatch(named, reader, path) if reader is not None else None
    err = [(e.path, e.reason, e.hint) if e is not None else None]
    if dist.get_world_size() > 1:
        collectives.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise ConfigError(*err[0])
    for bucket in _buckets(named, limit):
        with GatheredParameters([p for _, p in bucket], modifier_rank=0, enabled=zero3), torch.no_grad():
            for name, p in bucket:
                if reader is not None:
                    p.copy_(reader.get(name).to(p.dtype))
                if not zero3 and dist.get_world_size() > 1:
                    collectives.broadcast(p.data, src=0)
    return {n for n, _ in named}


def _model_meta(engine, model, model_path: str) -> None:
    """The model dir's facts export needs (the base's reading), onto the engine and the built model."""
    engine._read_model_meta(model_path)
    model.generation_config = engine.generation_config


def _construct(model_path: str, dtype, attn: str, contexts: list):
    """The HF causal LM of ``model_path``'s config with allocated but uninitialised weights (they are all
    loaded next), built inside ``contexts``; buffers (rotary ``inv_freq``) are computed from the config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = AutoConfig.from_pretrained(model_path)
    with ExitStack() as stack:
        stack.enter_context(no_init_weights())
        for c in contexts:
            stack.enter_context(c)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    model.tie_weights()  # init_weights (which ties) was skipped with the initialisation
    return model


def _fix_buffers(model, model_path: str, dtype, attn: str, src, device) -> None:
    """Put back the buffers zero.Init built wrong: it casts every floating tensor made during construction
    to the model dtype, so under bf16 the rotary ``inv_freq`` (fp32 in ``from_pretrained``'s model, and
    what the positions are computed from) lost its precision. The buffers of a construction with the
    parameters on the meta device replace them; persistent ones the checkpoint holds are read from it
    (``src``: rank 0's reader, broadcast to the others). Collective."""
    ref = _construct(model_path, dtype, attn, [materialize._meta_parameters()])
    want = dict(ref.named_buffers())
    for mod_name, mod in model.named_modules():
        for name, b in list(mod._buffers.items()):
            full = f"{mod_name}.{name}" if mod_name else name
            if b is None or full not in want:
                continue
            new = want[full].to(device)
            if name not in mod._non_persistent_buffers_set and src is not None and full in src:
                new = src.get(full).to(device, new.dtype)
            if name not in mod._non_persistent_buffers_set and dist.get_world_size() > 1:
                collectives.broadcast(new, src=0)
            mod._buffers[name] = new


def _finish_model(engine, model, model_path: str, dtype, rng: torch.Tensor):
    """The value head or LoRA adapter, drawn from the RNG state right after the engine's seed (what
    ``from_pretrained``, which draws nothing, leaves it at), so they match fsdp's."""
    torch.set_rng_state(rng)
    if engine.critic:
        engine._attach_value_head(model, model_path, dtype)
    elif lora_mod.enabled(engine.lora_cfg):
        engine.peft_config = lora_mod.inject(model, engine.lora_cfg)
    precision.fp32_head(model.lm_head)


def build_zero3_model(engine, model_path: str, dtype, ds_config: dict):
    """The model built inside ``deepspeed.zero.Init``: each rank holds only its partition of every
    parameter from construction on (a module's parameters are whole only until its ``__init__`` ends).
    The weights are then loaded bucket by bucket, gathered, with rank 0 alone reading the checkpoint."""
    deepspeed = import_deepspeed()
    attn = ulysses.register(engine.cfg.attn_impl, engine.device)
    # bf16 compute: DeepSpeed takes a zero.Init model's parameters as already in bf16.
    mdtype = torch.bfloat16 if engine._bf16 else dtype
    torch.manual_seed(engine.seed)
    rng = torch.get_rng_state()
    # dtype=None: zero.Init takes it from the config's bf16 switch (bf16 or fp32), i.e. mdtype. An explicit
    # dtype is overridden by bf16 on an accelerator without fp16 (the CPU one; `dtype or fp16 if ... else`).
    model = _construct(model_path, mdtype, attn,
                       [deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=None, enabled=True)])
    # The head's own weight, replaced by the tie, is left in a reference cycle: free its partition now.
    gc.collect()
    _model_meta(engine, model, model_path)
    reader = engine._checkpoint(model_path) if dist.get_rank() == 0 else None
    _fix_buffers(model, model_path, mdtype, attn, reader, engine.device)
    _take_table(engine, model, model_path, dtype)
    named = [(n, p) for n, p in model.named_parameters() if not (engine.critic and n.startswith("lm_head."))]
    limit = int(engine.cfg.deepspeed.bucket_mel * 1e6)
    engine._loaded = _copy_from_rank0(named, reader, model_path, True, limit)
    _finish_model(engine, model, model_path, dtype, rng)
    if engine.critic and (Path(model_path) / VALUE_HEAD_FILE).is_file():
        engine._loaded |= {n for n, _ in model.named_parameters() if n.startswith("lm_head.")}
    # Parameters added after zero.Init (head, adapter) are whole; DeepSpeed partitions them at initialize.
    for p in model.parameters():
        if not hasattr(p, "ds_id"):
            p.data = p.data.to(engine.device)
    return model


def _take_table(engine, model, model_path: str, dtype) -> None:
    """``engine.tied_head``: the tied table out of ZeRO-3, row-sharded over the d x c ranks
    (:mod:`.zero3_table`), each rank reading its rows; before the gathered load, which then skips it."""
    engine._ztable = None
    if not sharded_vocab.wanted(engine.cfg.tied_head, engine.cfg.max_tokens_per_mb, model,
                                engine._meshes.fsdp_mesh.size(), zero3_table.refusal(engine)):
        return
    engine._ztable = zero3_table.Zero3Table(model, engine._meshes.fsdp_mesh, dtype,
                                            torch.bfloat16 if engine._bf16 else None, engine.device,
                                            trainable=engine.optim_cfg is not None)
    gc.collect()  # ZeRO's partition of the table, dropped from the modules
    engine._ztable.load(engine._checkpoint(model_path), model_path)
    engine._table = engine._ztable.table


def build_replicated_model(engine, model_path: str, dtype):
    """ZeRO-0/1/2 keep the weights whole on every rank by design: the model is allocated uninitialised
    and each tensor read into it from the checkpoint one at a time (no second full copy)."""
    attn = ulysses.register(engine.cfg.attn_impl, engine.device)
    torch.manual_seed(engine.seed)
    rng = torch.get_rng_state()
    model = _construct(model_path, dtype, attn, [])
    _model_meta(engine, model, model_path)
    src = engine._checkpoint(model_path)
    named = [(n, p) for n, p in model.named_parameters() if not (engine.critic and n.startswith("lm_head."))]
    err = _mismatch(named, src, model_path)
    if err is not None:
        raise err
    with torch.no_grad():
        for name, p in named:
            p.copy_(src.get(name).to(p.dtype))
        for name, b in model.named_buffers():  # persistent buffers the checkpoint holds, as from_pretrained
            if name in src:
                b.copy_(src.get(name).to(b.dtype))
    engine._loaded = {n for n, _ in named}
    _finish_model(engine, model, model_path, dtype, rng)
    if engine.critic:
        engine._loaded |= {n for n in src.names() if n.startswith("lm_head.")}
    return model.to(engine.device)


def share_fp32_partitions(ds_optimizer) -> int:
    """Let a ZeRO-3 optimizer step the module's own fp32 partitions instead of copies of them.

    DeepSpeed 0.19.8 means to (``stage3._create_fp32_partitions`` appends the module's flat partition when
    dtype and device match) but compares a ``torch.device`` with the accelerator's device name, a string,
    which is never equal; so an fp32 module's partition is held twice (weights / ranks, 0.46 GiB per rank of
    a 0.5B model at d4). After each step DeepSpeed copies the masters into the module's partition, which is
    then a copy onto itself. Returns how many sub-groups now share."""
    flat16 = getattr(ds_optimizer, "fp16_partitioned_groups_flat", None) or []
    flat32 = getattr(ds_optimizer, "fp32_partitioned_groups_flat", None) or []
    if getattr(ds_optimizer, "offload_optimizer", False) or getattr(ds_optimizer, "offload_param", False):
        return 0
    shared = 0
    for a, b in zip(flat16, flat32):
        if a is None or b is None or a is b or a.data_ptr() == b.data_ptr():
            continue
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device) or not torch.equal(a, b):
            continue
        b.data = a.data  # the optimizer keys its state by this tensor object; its storage is now the module's
        shared += 1
    return shared


def restore_fp32_masters(engine, path: str, fresh: dict[str, torch.Tensor]) -> None:
    """Put the fp32 master weights back after ``deepspeed.initialize`` built them from the bf16 module:
    from the checkpoint, one tensor at a time (under ZeRO-3 each rank reads only its own partition's
    rows), and ``fresh`` (the fp32 values of parameters the checkpoint lacks). Not collective."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_full_fp32_param, safe_set_local_fp32_param

    src = engine._checkpoint(path)
    for name, p in engine.ds.module.named_parameters():
        if not p.requires_grad:
            continue
        if engine.zero_stage == 3:
            # This rank's partition: elements [rank * n, (rank + 1) * n) of the flattened tensor; the last
            # one's padding keeps its value.
            n = p.ds_tensor.ds_numel
            lo = n * dist.get_rank(group=p.ds_process_group)
            hi = min(lo + n, p.ds_numel)
            local = safe_get_local_fp32_param(p).clone()
            if hi > lo:
                part = fresh[name].reshape(-1)[lo:hi] if name in fresh else src.get_flat(name, lo, hi)
                local.view(-1)[:hi - lo].copy_(part)
            safe_set_local_fp32_param(p, local)
        else:
            full = fresh[name] if name in fresh else src.get(name)
            safe_set_full_fp32_param(p, full.to(engine.device, torch.float32))


class DeepSpeedEngine(HFModelEngine):
    """DeepSpeed ZeRO-1/2/3 data parallelism of HF causal LMs (optimizer/parameter offload on GPU nodes)."""

    dims = DEEPSPEED.dims  # its spec (engines/specs.py) is the one place that says them
    _ztable: zero3_table.Zero3Table | None = None  # the tied table row-sharded outside ZeRO-3

    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        from areal_cli.utils.dist import default_device, init_distributed

        deepspeed = import_deepspeed()
        init_distributed()
        self.device = torch.device(kwargs.get("device") or default_device())
        self.parallel, self.model_path = parallel, model_path
        self._check(parallel)
        # fsdp's (dp, cp) mesh gives the dp and Ulysses groups; ZeRO partitions over all dp × cp ranks.
        self._meshes = par.build_meshes(parallel, self.device.type)
        # engines/precision.py: a trained model's weights are fp32 (DeepSpeed's bf16 mode keeps the fp32
        # masters; the module holds bf16 copies), a forward-only one's are bf16 under bf16 compute.
        self.precision = precision.resolve(self.cfg.dtype, trainable=self.optim_cfg is not None)
        dtype = self.precision.params
        self._bf16 = self.precision.compute == torch.bfloat16
        self._fp32_master = self._bf16 and dtype == torch.float32
        config = self._ds_config()
        if self.zero_stage == 3:
            model = build_zero3_model(self, model_path, dtype, config)
        else:
            model = build_replicated_model(self, model_path, dtype)
        if self.cfg.gradient_checkpointing:
            par.enable_gradient_checkpointing(model)
        self.hf_config = model.config
        self._build_optimizer(model.parameters())
        restore = self._fp32_master and self.optimizer is not None
        # bf16 mode builds the fp32 master partitions from the bf16 module: they are put back from the
        # checkpoint afterwards, as fsdp's mixed precision keeps fp32 weights. Only the parameters the
        # checkpoint lacks (a fresh value head, the LoRA adapter: small) are kept here until then.
        fresh = ({n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()
                  if p.requires_grad and n not in self._loaded} if restore else {})
        if self.zero_stage == 3 and self._bf16:
            # DeepSpeed takes a zero.Init model's parameters as already in bf16: the ones added after
            # construction (value head, adapter) are cast here, their fp32 values kept above.
            for p in model.parameters():
                if not hasattr(p, "ds_id") and p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=config,
                                                dist_init_required=False)
        if restore:
            restore_fp32_masters(self, model_path, fresh)
        elif self.zero_stage == 3 and self.optimizer is not None:
            share_fp32_partitions(self.ds.optimizer)
        if self._ztable is not None and self.optimizer is not None:
            self._ztable.count_in(self.ds.optimizer)
        self.model = self.ds
        if self.optimizer is None:
            self.model.eval()
        host_memory.release()  # the full tensors of construction and of the gathered load buckets

    def _check(self, parallel: ParallelStrategy) -> None:
        from transformers import AutoConfig

        if parallel.tp != 1 or parallel.pp != 1:
            raise ConfigError("allocation_mode", f"the deepspeed engine runs d and c dims only, got "
                              f"t={parallel.tp} p={parallel.pp}",
                              "drop t/p from the deepspeed part, or use engine=archon or engine=megatron")
        par.check_strategy(parallel, dist.get_world_size())
        if not (Path(self.model_path) / "config.json").is_file():
            raise ConfigError("model.path", f"{self.model_path} is not an HF model dir (no config.json)",
                              "point model.path at a local dir with config.json and safetensors")
        heads = AutoConfig.from_pretrained(self.model_path).num_attention_heads
        if heads % parallel.cp:
            raise ConfigError("allocation_mode", f"c{parallel.cp} does not divide "
                              f"num_attention_heads={heads}", "pick c that divides the head count")
        check_deepspeed_knobs(self.cfg)

    def _ds_config(self) -> dict:
        z = self.cfg.deepspeed
        bucket = int(z.bucket_mel * 1e6)
        zero: dict[str, Any] = {"stage": int(z.zero_stage), "overlap_comm": False, "reduce_scatter": True,
                                "contiguous_gradients": z.zero_stage >= 2, "reduce_bucket_size": bucket,
                                "allgather_bucket_size": bucket}
        if z.zero_stage == 3:
            zero.update(stage3_param_persistence_threshold=int(z.param_persistence_threshold),
                        stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=bucket,
                        stage3_max_reuse_distance=bucket)
        pin = self.device.type == "cuda"
        if z.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if z.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        # An infinite threshold still has DeepSpeed compute the norm (reported as grad_norm) at every stage.
        clip = inf
        if self.optim_cfg is not None and self.optim_cfg.grad_clip > 0:
            clip = float(self.optim_cfg.grad_clip)
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            # One accumulation step in the config; the engine sets the boundary on its last micro-batch.
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            # Offload with the torch optimizer, not DeepSpeedCPUAdam (a C++ op compiled at run time).
            "zero_force_ds_cpu_optimizer": False,
            "gradient_clipping": clip,
            "fp16": {"enabled": False},
            "bf16": {"enabled": self._bf16},
            "steps_per_print": 2 ** 62,
            "wall_clock_breakdown": False,
        }
        if self._bf16:
            cfg["communication_data_type"] = "fp32"  # as fsdp's reduce_dtype: sum gradients in fp32
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        return cfg

    @property
    def zero_stage(self) -> int:
        return int(self.cfg.deepspeed.zero_stage)

    # ------------------------------------------------------------------ train
    def _begin_micro_batch(self, last: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(last)

    def _backward(self, scaled_loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over its ranks (dp × cp): scale back up to the engine's sum. Under
        # Ulysses each cp rank back-propagates its slice of the sequence, so the sum over cp is whole.
        self.ds.backward(scaled_loss * dist.get_world_size(), scale_wrt_gas=False)

    def train_batch(self, batch: Batch | None, loss_fn: LossFn, loss_weight_fn: LossWeightFn,
                    temperature: float = 1.0) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_batch on an inference-only engine (constructed with optim_cfg=None)")
        loss_sum, stat_sums, denom, n_mb = self._accumulate_grads(batch, loss_fn, loss_weight_fn, temperature)
        lr = self.optimizer.param_groups[0]["lr"]
        if self._ztable is not None:
            self._ztable.prepare()  # its norm joins DeepSpeed's (zero3_table.py)
        self.ds.step()  # at the boundary: reduce, clip, optimizer step, zero the gradients
        if self._ztable is not None:
            self._ztable.step(self.ds.optimizer, self.optimizer.param_groups[0])
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        self.scheduler.step()
        self.step += 1
        return self._reduce_stats(loss_sum, stat_sums, denom, grad_norm, lr, n_mb)

    def warm_up(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to warm: a throw-away DeepSpeed step would advance its step counters and, under
        ZeRO, cannot be undone exactly (the optimizer's fp32 partitions are rebuilt from weights)."""

    # ------------------------------------------------------------------ full weights
    def _param_buckets(self, include_value_head: bool = True, keep=None):
        """Named parameters (tied ones once) in buckets of about ``bucket_mel`` elements; ``keep(name)``:
        only those (the LoRA adapter)."""
        named = ((n, p) for n, p in self.ds.module.named_parameters()
                 if not (self.critic and n.startswith("lm_head.") and not include_value_head)
                 and (keep is None or keep(n)))
        yield from _buckets(named, int(self.cfg.deepspeed.bucket_mel * 1e6))

    def _named_full_tensors(self, include_value_head: bool = True, to_cpu: bool = True, keep=None):
        """``(name, full tensor)`` on global rank 0 and ``(name, None)`` elsewhere, in the same order on
        every rank; under ZeRO-3 each bucket is all-gathered (a collective), copied, and released."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param

        src = dist.get_rank() == 0
        if self._ztable is not None and keep is None:  # row-sharded outside ZeRO: gathered as fsdp's table
            yield from self._stream_tensor(self._ztable.name, self._ztable.weight, to_cpu, src)

        def out(t: torch.Tensor):
            if not src:
                return None
            t = t.detach()
            return t.to("cpu", copy=True) if to_cpu else t.clone()

        for bucket in self._param_buckets(include_value_head, keep):
            if self._fp32_master and self.optimizer is not None:
                # bf16 compute: the module holds bf16 copies; the weights are the fp32 master partitions.
                for name, p in bucket:
                    yield name, out(safe_get_full_fp32_param(p))
                continue
            with GatheredParameters([p for _, p in bucket], modifier_rank=None, enabled=self.zero_stage == 3):
                tensors = [(name, out(p)) for name, p in bucket]
            yield from tensors
        params = {n for n, _ in self.ds.module.named_parameters(remove_duplicate=False)}
        for name, b in self.ds.module.state_dict().items():
            if name not in params and keep is None:  # persistent buffers: whole on every rank
                yield name, out(b)

    def _load_hf(self, path: str) -> None:
        """HF weights into the running engine: bucket by bucket, rank 0 alone reading the dir (under ZeRO-3
        each gathered bucket is re-partitioned from rank 0's values; otherwise broadcast), then the
        optimizer's fp32 master copies from them (with fp32 masters under bf16: from the checkpoint)."""
        named = [(n, p) for n, p in self.ds.module.named_parameters()]
        limit = int(self.cfg.deepspeed.bucket_mel * 1e6)
        reader = self._checkpoint(path) if dist.get_rank() == 0 else None
        _copy_from_rank0(named, reader, path, self.zero_stage == 3, limit)
        if self._ztable is not None:
            self._ztable.load(self._checkpoint(path), path)
        if self.optimizer is not None and hasattr(self.ds.optimizer, "refresh_fp32_params"):
            self.ds.optimizer.refresh_fp32_params()
        if self._fp32_master and self.optimizer is not None:
            restore_fp32_masters(self, path, {})

    # ------------------------------------------------------------------ checkpoints
    def _save_dcp(self, meta: SaveLoadMeta) -> None:
        Path(meta.path).mkdir(parents=True, exist_ok=True)
        collectives.barrier()
        # Under LoRA the frozen base is the model dir's: the checkpoint holds the adapter and optimizer.
        self.ds.save_checkpoint(meta.path, tag=CHECKPOINT_TAG, save_latest=False,
                                exclude_frozen_parameters=self.peft_config is not None)
        extra = {"step": self.step, "version": self._version,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 "zero_stage": self.zero_stage, "world_size": dist.get_world_size(),
                 "table": None if self._ztable is None else self._ztable.state_dict(),
                 "extra_state": meta.extra_state}
        torch.save(extra, Path(meta.path) / f"extra_rank{dist.get_rank()}.pt")
        collectives.barrier()

    def _load_dcp(self, meta: SaveLoadMeta) -> None:
        """DeepSpeed's checkpoint (module and ZeRO optimizer partitions) plus step, version and LR schedule;
        the saved ``extra_state`` is merged into ``meta.extra_state``."""
        extra_file = Path(meta.path) / f"extra_rank{dist.get_rank()}.pt"
        if not extra_file.is_file() or not (Path(meta.path) / CHECKPOINT_TAG).is_dir():
            raise ConfigError("recover.path", f"{meta.path} is not a deepspeed checkpoint of this rank "
                              f"(no {extra_file.name} or {CHECKPOINT_TAG}/)",
                              "point at a dir written by the deepspeed engine with the same world size")
        extra = torch.load(extra_file, weights_only=False)
        if (extra["zero_stage"], extra["world_size"]) != (self.zero_stage, dist.get_world_size()):
            raise ConfigError("engine.deepspeed.zero_stage", f"the checkpoint was written by ZeRO-"
                              f"{extra['zero_stage']} on {extra['world_size']} ranks, this run is ZeRO-"
                              f"{self.zero_stage} on {dist.get_world_size()}",
                              "resume with the same zero_stage and d, or start from its HF export")
        path, _ = self.ds.load_checkpoint(meta.path, tag=CHECKPOINT_TAG,
                                          load_optimizer_states=self.optimizer is not None,
                                          load_lr_scheduler_states=False,
                                          load_module_strict=self.peft_config is None)
        if path is None:
            raise ConfigError("recover.path", f"deepspeed could not load {meta.path}/{CHECKPOINT_TAG}",
                              "point at a complete checkpoint dir")
        self.step, self._version = extra["step"], extra["version"]
        if self._ztable is not None:
            self._ztable.load_state_dict(extra.get("table"),
                                         None if self.optimizer is None else self.optimizer.param_groups[0])
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        meta.extra_state.update(extra.get("extra_state") or {})

    def destroy(self) -> None:
        super().destroy()
        ds = getattr(self, "ds", None)
        if ds is not None:
            ds.destroy()
            self.ds = None

