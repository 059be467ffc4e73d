"""The DeepSpeed engine: ZeRO stages 0-3 over the d × c ranks (Ulysses for c, as fsdp), on CPU (gloo)
and CUDA (nccl).

The HF model is loaded whole on every rank and handed to ``deepspeed.initialize`` with the project's
own torch AdamW and LR schedule (DeepSpeed's fused/CPU Adam kernels are C++ built at run time, which a
CPU host without a toolchain cannot do, and the torch optimizer keeps the schedules and numerics of the
other engines). Micro-batching, the loss normalisation, logprobs, weight-sync senders and HF export are
:class:`~areal_cli.engines.fsdp.FSDPEngine`'s; what differs is how a step runs and how full weights
are reached:

- DeepSpeed averages gradients over the data-parallel ranks and divides each backward by its
  accumulation steps. The engine's losses are already normalised by the global loss weight, so every
  backward runs with ``scale_wrt_gas=False`` and the loss multiplied by the dp size.
- The number of micro-batches changes from step to step: the config fixes one accumulation step and
  the engine marks the last micro-batch as the boundary itself. Ranks with fewer micro-batches run
  zero-weight forwards (ZeRO-3 gathers parameters in every forward, a collective).
- Gradient clipping is DeepSpeed's (``gradient_clipping``), over the partitioned gradients; its norm
  is the reported ``grad_norm``.
- Full weights (HF export, weight sync) are gathered bucket by bucket with
  ``deepspeed.zero.GatheredParameters`` (a collective on every rank); with bf16 compute over fp32
  weights the fp32 master copies are gathered instead.
- ``weight_format="dcp"`` checkpoints are DeepSpeed's own ``save_checkpoint``/``load_checkpoint``
  (module, ZeRO partitions of the optimizer) plus a per-rank file with the step, version and LR schedule;
  they resume bit-exact on the same number of ranks.
"""

from __future__ import annotations

import logging
import os
from math import inf
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch, LossFn, LossWeightFn
from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
from areal_cli.engines import check_deepspeed_knobs, ulysses
from areal_cli.engines import parallelize as par
from areal_cli.engines.fsdp import FSDPEngine
from areal_cli.errors import ConfigError

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


class DeepSpeedEngine(FSDPEngine):
    """DeepSpeed ZeRO-1/2/3 data parallelism of HF causal LMs (optimizer/parameter offload on GPU nodes)."""

    dims = "dc"

    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        from areal_cli.utils.dist import default_device, init_distributed

        deepspeed = import_deepspeed()
        init_distributed()
        self.device = torch.device(kwargs.get("device") or os.environ.get("AREAL_DEVICE") or default_device())
        self.parallel, self.model_path = parallel, model_path
        self._check(parallel)
        model, dtype = self._load_hf_model(model_path)
        model.to(self.device)
        if self.cfg.gradient_checkpointing:
            par.enable_gradient_checkpointing(model)
        self.hf_config = model.config
        # fsdp's (dp, cp) mesh gives the dp and Ulysses groups; ZeRO partitions over all dp × cp ranks.
        self._meshes = par.build_meshes(parallel, self.device.type)
        ulysses.set_ulysses_group(self._meshes.cp_group if parallel.cp > 1 else None)
        self._bf16 = dtype == torch.bfloat16 or (self.cfg.mixed_precision and dtype == torch.float32)
        self._fp32_master = self._bf16 and dtype == torch.float32
        self._build_optimizer(model.parameters())
        # bf16 mode casts the module to bf16 before it builds the fp32 master partitions from it: keep the
        # fp32 weights (on the host) to put them back, as fsdp's mixed precision keeps them.
        fp32 = ({n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
                if self._fp32_master and self.optimizer is not None else None)
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer,
                                                config=self._ds_config(), dist_init_required=False)
        if fp32 is not None:
            from deepspeed.utils import safe_set_full_fp32_param

            for name, p in self.ds.module.named_parameters():
                safe_set_full_fp32_param(p, fp32[name].to(self.device))
            del fp32
        self.model = self.ds
        if self.optimizer is None:
            self.model.eval()

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
        self.ds.step()  # at the boundary: reduce, clip, optimizer step, zero the gradients
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
        limit = int(self.cfg.deepspeed.bucket_mel * 1e6)
        bucket: list = []
        size = 0
        for name, p in self.ds.module.named_parameters():
            if self.critic and name.startswith("lm_head.") and not include_value_head:
                continue
            if keep is not None and not keep(name):
                continue
            n = int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
            if bucket and size + n > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, p))
            size += n
        if bucket:
            yield bucket

    def _named_full_tensors(self, include_value_head: bool = True, to_cpu: bool = True, keep=None):
        """``(name, full tensor)`` on global rank 0 and ``(name, None)`` elsewhere, in the same order on
        every rank; under ZeRO-3 each bucket is all-gathered (a collective), copied, and released."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param

        src = dist.get_rank() == 0

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
        """Full HF weights into every rank's partition (and the optimizer's fp32 master copy)."""
        from deepspeed.runtime.zero import GatheredParameters

        full = self._read_hf(path)
        missing = [n for n, _ in self.ds.module.named_parameters() if n not in full]
        if missing:
            raise ConfigError("model.path", f"{path} lacks {len(missing)} parameters of the model "
                              f"(e.g. {missing[0]})", "load an HF export of the same architecture")
        for bucket in self._param_buckets():
            with GatheredParameters([p for _, p in bucket], modifier_rank=0, enabled=self.zero_stage == 3):
                with torch.no_grad():
                    for name, p in bucket:
                        p.copy_(full[name].to(p.dtype))
        if self.optimizer is not None and hasattr(self.ds.optimizer, "refresh_fp32_params"):
            self.ds.optimizer.refresh_fp32_params()

    # ------------------------------------------------------------------ checkpoints
    def _save_dcp(self, meta: SaveLoadMeta) -> None:
        Path(meta.path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        # Under LoRA the frozen base is the model dir's: the checkpoint holds the adapter and optimizer.
        self.ds.save_checkpoint(meta.path, tag=CHECKPOINT_TAG, save_latest=False,
                                exclude_frozen_parameters=self.peft_config is not None)
        extra = {"step": self.step, "version": self._version,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                 "zero_stage": self.zero_stage, "world_size": dist.get_world_size(),
                 "extra_state": meta.extra_state}
        torch.save(extra, Path(meta.path) / f"extra_rank{dist.get_rank()}.pt")
        dist.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        """``dcp``: DeepSpeed's checkpoint (module and ZeRO optimizer partitions) plus step, version and LR
        schedule; the saved ``extra_state`` is merged into ``meta.extra_state``. ``hf``: weights."""
        if meta.weight_format == "hf":
            self._load_hf(meta.path)
            return
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
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        meta.extra_state.update(extra.get("extra_state") or {})

    def destroy(self) -> None:
        super().destroy()
        ds = getattr(self, "ds", None)
        if ds is not None:
            ds.destroy()
            self.ds = None

