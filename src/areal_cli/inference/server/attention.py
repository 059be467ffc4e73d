"""An SDPA attention for HF models that keeps grouped-query attention native under a padding mask.

HF's stock ``sdpa`` path expands K/V to every query head (``repeat_kv``: a full copy of the cache,
every layer, every step) whenever an attention mask is present — which is always, for a
left-padded continuous batch. ``torch``'s SDPA takes ``enable_gqa=True`` with a mask, so we
register the same function minus that copy under the name ``areal_sdpa``.
"""

from __future__ import annotations

import torch

NAME = "areal_sdpa"
_registered = False


def areal_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
        scale=scaling, is_causal=causal, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def use_areal_sdpa(model) -> bool:
    """Switch ``model`` to ``areal_sdpa`` when it runs HF's ``sdpa``; returns whether it did."""
    global _registered
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if not _registered:
        AttentionInterface.register(NAME, areal_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
