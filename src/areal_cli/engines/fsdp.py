"""FSDP2 training engine: ``fully_shard`` over a ``(dp, cp)`` mesh, Ulysses for ``cp``.

Runs the same code on CPU (gloo) and CUDA (nccl). Batch format, position convention and loss
normalisation are defined in :mod:`areal_cli.api.engine_api`. Data layout across ranks:

- ``train_batch``/``forward`` take the *rank-local* batch of this data-parallel replica (use
  :func:`areal_cli.engines.packing.split_batch_for_dp` to cut a global batch). Inside a Ulysses group
  only the head (``is_dp_head``) needs to pass a batch; the others may pass ``None``.
- Every rank returns the same stats; ``forward`` returns outputs for the replica's batch.

The model is built on the meta device, sharded, then each rank reads its own shard of every parameter
(:mod:`areal_cli.engines.materialize`): no rank holds the whole model.

Gradients are reduce-scattered after every micro-batch by default (``engine.grad_reduce=per_micro_batch``,
torchtitan's choice): each rank then keeps only its shard of the accumulated gradient. With
``last_micro_batch`` FSDP2 keeps every layer's *unsharded* gradient (in ``reduce_dtype``) until the last
micro-batch and reduces once: one collective per step instead of one per micro-batch, at the cost of a
full-model gradient per rank. It wins only where communication dominates and the model is small next to
the device (docs/training.md).

Critic (``critic=True``): the LM head is replaced by a ``Linear(hidden, 1)`` value head.
``values[i]`` is the value of the state *before* token ``i`` (the head applied to the hidden state
of token ``i-1``), matching the position convention. HF export writes the backbone to
``model.safetensors`` and the head to ``value_head.safetensors`` (keys ``weight``, ``bias``);
initializing a critic from a dir that has ``value_head.safetensors`` restores it.
"""

from __future__ import annotations

from typing import Any

import torch

from areal_cli.api.io_struct import ParallelStrategy
from areal_cli.engines import parallelize as par, sharded_vocab, tied_embedding, vision
from areal_cli.engines.base import VALUE_HEAD_FILE  # noqa: F401  (re-exported: the critic's head file)
from areal_cli.engines.hf_model import HFModelEngine, _full  # noqa: F401
from areal_cli.engines.specs import FSDP
from areal_cli.errors import ConfigError


class FSDPEngine(HFModelEngine):
    """PyTorch FSDP2 data parallelism with Ulysses context parallelism over HF causal LMs."""

    dims = FSDP.dims  # its spec (engines/specs.py) is the one place that says them

    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        from areal_cli.utils.dist import default_device, init_distributed

        init_distributed()
        self.device = torch.device(kwargs.get("device") or default_device())
        self.parallel = parallel
        self.model_path = model_path
        self._meshes = par.build_meshes(parallel, self.device.type)
        self.freeze_vision_tower = bool(kwargs.get("freeze_vision_tower", False))
        model, _ = self._build_meta_model(model_path)
        heads = vision.text_config(model.config).num_attention_heads
        if parallel.cp > 1 and heads % parallel.cp:
            raise ConfigError("allocation_mode", f"c{parallel.cp} does not divide num_attention_heads="
                              f"{heads}", "pick c that divides the head count")
        if self.cfg.gradient_checkpointing:
            par.enable_gradient_checkpointing(model)
        mp = self.precision.mixed  # bf16 compute over fp32 masters (engines/precision.py)
        self._table = None
        if sharded_vocab.wanted(self.cfg.tied_head, self.cfg.max_tokens_per_mb, model, self._meshes.fsdp_mesh.size()):
            self._table = sharded_vocab.install(model, self._meshes.fsdp_mesh, self.precision.compute if mp else None)
        else:
            tied_embedding.add_rows_into_tied_head(model)  # no dense [V, H] temporary in the backward
        # One rank (dp x cp == 1) has nothing to shard: as torchtitan, leave the module plain. FSDP's
        # hooks and DTensor dispatch cost ~15% of a step of the embedded default for no effect.
        # Mixed precision on one rank is autocast around the forward: the fp32 weights stay the module's
        # and its matmuls run in bf16 (AMX on CPU: 1.06 TFLOP/s against fp32's 0.16 for a [1000, 256] x
        # [256, 1024] matmul on one core here), while FSDP's policy would cast every parameter every step.
        if self._meshes.fsdp_mesh.size() > 1:
            par.apply_fsdp(model, self._meshes.fsdp_mesh, param_dtype=self.precision.compute if mp else None,
                           reduce_dtype=torch.float32 if mp else None, extra_modules=tuple(vision.tower_units(model)),
                           ignored=() if self._table is None else (self._table.weight,))
        self._materialise([model])
        if self._meshes.fsdp_mesh.size() == 1 and mp:
            model.forward = torch.autocast(self.device.type, dtype=self.precision.compute)(model.forward)
        self.model = model
        self._build_optimizer(model.parameters())
        self.hf_config = model.config
