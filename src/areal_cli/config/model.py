"""``model`` group: which model, plus the architecture facts validation needs.

Presets carry the facts for common models so ``validate-config`` needs no weights. With
``model.path=<local HF dir>`` the facts are read from that dir's ``config.json`` instead (plain
JSON, no torch). ``path=builtin:tiny`` means the tiny CPU model that areal builds on first use. A hub
id (``Qwen/Qwen2.5-0.5B-Instruct``) is fetched into the HF cache by ``areal train`` (models/hub.py); once
cached, its ``config.json`` supplies the facts like a local dir's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged

# LoRA target presets: the projection names of the decoder families we ship (Qwen2/2.5, Qwen3, Llama,
# Mistral all use these; Qwen3-MoE's experts are left out, its attention is targeted).
LORA_PRESETS: dict[str, tuple[str, ...]] = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
# model_type -> preset used by ``target_modules=auto``
LORA_FAMILY_PRESET: dict[str, str] = {"qwen2": "all", "qwen3": "all", "llama": "all", "mistral": "all",
                                      "qwen3_moe": "attention", "qwen2_moe": "attention"}


@dataclass
class LoRAConfig:
    """``model.lora``: low-rank adapters through peft (rank 0: off, full fine-tuning)."""

    rank: int = ranged(0, ge=0, why="0 disables LoRA")
    alpha: float = ranged(16.0, gt=0)
    dropout: float = ranged(0.0, ge=0, lt=1)
    # "auto" (the model family's preset), a preset name (attention, mlp, all), or module names "q_proj,v_proj"
    target_modules: str = "auto"


@dataclass
class VisionTowerConfig:
    """``model.vision``: the vision encoder of a vision-language model (a Qwen2.5-VL or Qwen2-VL ViT and patch
    merger; ``family`` says which layout, :data:`VISION_FAMILIES`).

    ``depth`` 0 is a text-only model. The facts size the memory estimate (allocation/estimate.py); the fsdp and
    archon engines train and the hf server serves such a model with images (docs/vision.md)."""

    depth: int = ranged(0, ge=0, why="0 is a text-only model")
    # the tower's layout, as the HF model_type names it: qwen2_5_vl (RMSNorm, gated MLP, windowed blocks) or
    # qwen2_vl (LayerNorm, plain GELU MLP); the sizes below mean the same in both (the ViT's width and MLP width)
    family: str = "qwen2_5_vl"
    hidden_size: int = ranged(0, ge=0)
    intermediate_size: int = ranged(0, ge=0)
    num_heads: int = ranged(0, ge=0)
    patch_size: int = ranged(14, ge=1)
    temporal_patch_size: int = ranged(2, ge=1)
    spatial_merge_size: int = ranged(2, ge=1)
    in_channels: int = ranged(3, ge=1)
    # the merger's output width: the language model's hidden_size (0 means that)
    out_hidden_size: int = ranged(0, ge=0, why="0 is the language model's hidden_size")


def is_vision_language(m) -> bool:
    """True when the ``model`` section describes a vision-language model (it has a vision tower)."""
    vision = getattr(m, "vision", None)
    return vision is not None and int(vision.depth) > 0


VISION_FAMILIES = ("qwen2_5_vl", "qwen2_vl")


def vision_tower_params(v: VisionTowerConfig, lm_hidden: int) -> int:
    """Parameters of a Qwen2.5-VL or Qwen2-VL vision tower: a bias-free Conv3d patch embed, ``depth`` blocks
    and the merger (a norm, two Linears with biases over ``spatial_merge_size**2`` concatenated patches). A
    Qwen2.5-VL block has 2 RMSNorms, fused qkv and proj with biases and a SwiGLU MLP with biases; a Qwen2-VL
    block 2 LayerNorms (weight and bias), the same attention and a plain 2-Linear MLP with biases, and its
    merger's norm is a LayerNorm too. 0 without a tower."""
    if v.depth <= 0:
        return 0
    h, i = v.hidden_size, v.intermediate_size
    norm = 2 * h if v.family == "qwen2_vl" else h  # LayerNorm's bias
    mlp = 2 * h * i + i + h if v.family == "qwen2_vl" else 3 * h * i + 2 * i + h
    embed = v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * h
    block = 2 * norm + (3 * h * h + 3 * h) + (h * h + h) + mlp
    cat, out = h * v.spatial_merge_size ** 2, v.out_hidden_size or lm_hidden
    merger = norm + cat * cat + cat + cat * out + out
    return embed + v.depth * block + merger


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str = "builtin:tiny"
    # hub ids only: the branch, tag or commit to fetch ("" = the repo's default branch)
    revision: str = ""
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
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    vision: VisionTowerConfig = field(default_factory=VisionTowerConfig)
    # a vision-language model's tower keeps its weights: no gradient, no optimizer state (docs/vision.md)
    freeze_vision_tower: bool = False


# Facts read from a local model dir's config.json: ModelConfig field -> config.json keys, first wins.
HF_FACTS = {
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads", "num_attention_heads", "n_head"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_topk"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "tie_word_embeddings": ("tie_word_embeddings",),
}

# Facts of a Qwen2.5-VL dir's ``vision_config``: VisionTowerConfig field -> keys, first wins.
VISION_FACTS = {
    "depth": ("depth",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size",),
    "num_heads": ("num_heads",),
    "patch_size": ("patch_size", "spatial_patch_size"),
    "temporal_patch_size": ("temporal_patch_size",),
    "spatial_merge_size": ("spatial_merge_size",),
    "in_channels": ("in_channels", "in_chans"),
    "out_hidden_size": ("out_hidden_size",),
}
# Qwen2-VL's ``vision_config`` names the same facts otherwise: the ViT's width is ``embed_dim``, its MLP width
# ``embed_dim * mlp_ratio``, and ``hidden_size`` is the merger's output (the language model's width).
QWEN2_VL_VISION_FACTS = {**VISION_FACTS, "hidden_size": ("embed_dim",), "intermediate_size": (),
                         "out_hidden_size": ("hidden_size",)}


def _int(v: dict, keys: tuple[str, ...]) -> int | None:
    return next((int(v[k]) for k in keys if isinstance(v.get(k), int) and not isinstance(v.get(k), bool)), None)


def vision_facts(config_json: dict) -> dict[str, int | str]:
    """``model.vision`` facts from a HF ``config.json`` dict (empty for a text-only or unsupported model)."""
    v = config_json.get("vision_config")
    family = config_json.get("model_type")
    if family not in VISION_FAMILIES or not isinstance(v, dict):
        return {}
    names = QWEN2_VL_VISION_FACTS if family == "qwen2_vl" else VISION_FACTS
    out: dict[str, int | str] = {"family": family}
    for fld, keys in names.items():
        val = _int(v, keys)
        if val is not None:
            out[fld] = val
    if family == "qwen2_vl":
        width, ratio = _int(v, ("embed_dim",)), v.get("mlp_ratio", 4)  # transformers' default ratio is 4
        if width is not None and isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
            out["intermediate_size"] = int(width * ratio)  # VisionMlp's int(dim * mlp_ratio)
    return out


_KNOWN_MODULES = frozenset(LORA_PRESETS["all"])


def lora_target_modules(target_modules: str, model_type: str | None = None, *,
                        moe: bool = False) -> tuple[str, ...]:
    """The module names ``model.lora.target_modules`` stands for (a preset, ``auto`` or a comma list)."""
    from areal_cli.errors import ConfigError

    spec = (target_modules or "auto").strip()
    if spec == "auto":
        preset = LORA_FAMILY_PRESET.get(model_type or "", "attention" if moe else "all")
        return LORA_PRESETS[preset]
    if spec in LORA_PRESETS:
        return LORA_PRESETS[spec]
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    bad = [n for n in names if n not in _KNOWN_MODULES]
    if not names or bad:
        raise ConfigError("model.lora.target_modules", f"{target_modules!r} names no known projection"
                          + (f" ({', '.join(bad)})" if bad else ""),
                          f"use auto, a preset ({', '.join(LORA_PRESETS)}) or a comma list of "
                          f"{', '.join(sorted(_KNOWN_MODULES))}")
    return names
