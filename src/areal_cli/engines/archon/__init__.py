"""Archon: PyTorch-native parallelism (FSDP2 × TP × PP × CP) applied from outside to HF models.

Modules (import them directly; none imports torch at package import time):

- :mod:`.mesh`: ``ArchonDims`` and the ``(pp, dp, cp, tp)`` ``ArchonMesh``;
- :mod:`.tp_plans`: DTensor tensor-parallel plans per model family;
- :mod:`.vocab_parallel`: vocab-sharded ``lm_head`` and logprobs/entropy without a full-vocab gather;
- :mod:`.pipeline`: ``torch.distributed.pipelining`` stages and schedules for HF causal LMs;
- :mod:`.clip`: gradient-norm clipping over several meshes and pipeline stages;
- :mod:`.parallelize`: TP → activation checkpointing → FSDP2, in torchtitan's order.
"""
