"""``model`` group: which model, plus the architecture facts validation needs.

Presets carry the facts for common models so ``validate-config`` needs no weights. With
``model.path=<local HF dir>`` the facts are read from that dir's ``config.json`` instead (plain
JSON, no torch). ``path=builtin:tiny`` means the tiny CPU model that areal builds on first use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str = "builtin:tiny"
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    hidden_size: int = 64
    head_dim: int = 0  # 0 → hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    intermediate_size: int = 256
    vocab_size: int = 512
    num_experts: int = 0  # 0 = dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    # LoRA through peft; rank 0 disables.
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_target_modules: str = "all-linear"
