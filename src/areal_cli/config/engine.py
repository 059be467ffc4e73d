"""``engine`` group: which training backend runs the model and how."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    name: str = "fsdp"  # fsdp | megatron | archon | deepspeed
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16
    mixed_precision: bool = False  # compute in bfloat16 with fp32 master weights
    gradient_checkpointing: bool = False
    max_tokens_per_mb: int = 4096  # token budget per micro-batch (FFD packing)
    pad_to_multiple_of: int = 1
    padding_free: bool = True  # pack sequences without padding where the attention path allows
    # Samples that share a prompt (a GRPO group) run it once per micro-batch: exact, fewer tokens.
    shared_prefix: bool = True
    attn_impl: str = "sdpa"  # sdpa | eager | flash_attention_2
    # Megatron/DeepSpeed/Archon-specific knobs ride here too; unused ones are ignored by other engines.
    zero_stage: int = 3  # deepspeed
    sequence_parallel: bool = False  # megatron
    recompute_granularity: str = "selective"  # megatron
