"""``model`` group: which model, plus the architecture facts validation needs.

Presets carry the facts for common models so ``validate-config`` needs no weights. With
``model.path=<local HF dir>`` the facts are read from that dir's ``config.json`` instead (plain
JSON, no torch). ``path=builtin:tiny`` means the tiny CPU model that areal builds on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.ranges import ranged


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str = "builtin:tiny"
    num_attention_heads: int = ranged(4, ge=1)
    num_key_value_heads: int = ranged(2, ge=1)
    num_hidden_layers: int = ranged(2, ge=1)
    hidden_size: int = ranged(64, ge=1)
    # 0 → hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    head_dim: int = ranged(0, ge=0, why="0 derives it from hidden_size")
    intermediate_size: int = ranged(256, ge=1)
    vocab_size: int = ranged(512, ge=1)
    num_experts: int = ranged(0, ge=0, why="0 is a dense model")
    num_experts_per_tok: int = ranged(0, ge=0)
    moe_intermediate_size: int = ranged(0, ge=0)
    max_position_embeddings: int = ranged(1024, ge=1)
    tie_word_embeddings: bool = True
    # LoRA through peft; rank 0 disables.
    lora_rank: int = ranged(0, ge=0, why="0 disables LoRA")
    lora_alpha: int = ranged(16, ge=1)
    lora_target_modules: str = "all-linear"
