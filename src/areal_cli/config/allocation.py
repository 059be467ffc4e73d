"""``allocation_mode`` group: a preset name or a raw spec string in the allocation language."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AllocationModeConfig:
    # e.g. "hf:d1+fsdp:d1", "sglang.d4+megatron.d2t2p2", "vllm:d2t2|fsdp:d4"
    spec: str = "hf:d1+fsdp:d1"
