"""How many bytes a run writes to its fileroot, from the model's architecture facts alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_cli.config.model import ModelConfig
    from areal_cli.config.schema import ExperimentConfig

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def param_count(m: Any) -> int:
    """Parameters of a Qwen2/Llama/Mixtral-style decoder described by a ``ModelConfig``."""
    h = int(m.hidden_size)
    heads, kv = int(m.num_attention_heads), int(m.num_key_value_heads)
    head_dim = int(getattr(m, "head_dim", 0) or 0) or h // max(1, heads)
    q, kvd = heads * head_dim, kv * head_dim
    # q/k/v projections carry biases in Qwen2; the few extra params do not change the estimate's order.
    attn = h * q + q + 2 * (h * kvd + kvd) + q * h
    n_exp = int(getattr(m, "num_experts", 0) or 0)
    if n_exp > 0:
        inter = int(getattr(m, "moe_intermediate_size", 0) or 0) or int(m.intermediate_size)
        mlp = n_exp * 3 * h * inter + h * n_exp  # experts + router
    else:
        mlp = 3 * h * int(m.intermediate_size)  # gate, up, down
    per_layer = attn + mlp + 2 * h  # two RMSNorms
    embed = int(m.vocab_size) * h
    lm_head = 0 if getattr(m, "tie_word_embeddings", True) else embed
    return embed + int(m.num_hidden_layers) * per_layer + h + lm_head


def estimate_checkpoint_bytes(model_cfg: ModelConfig, keep: int, *, dtype: str = "float32",
                              with_optimizer: bool = True) -> int:
    """Bytes that ``keep`` retained checkpoints occupy.

    Each retained checkpoint is an HF export (params × dtype) plus, when resumable state is
    written, a recover state: the fp32 master weights (fp32 under every ``engine.dtype``:
    engines/precision.py) plus Adam's two fp32 moments (12 bytes/param in all). With
    ``keep`` of each on disk, and one more being written before the oldest is pruned, the peak
    is ``keep + 1`` checkpoints.
    """
    n = param_count(model_cfg)
    b = DTYPE_BYTES.get(str(dtype).lower(), 4)
    per_ckpt = n * b + (12 * n if with_optimizer else 0)
    return per_ckpt * (max(1, int(keep)) + 1)


def retained_checkpoints(trainer: Any) -> int:
    """How many checkpoints a run can hold at once: ``trainer.keep_checkpoints``, but no more than it saves
    (one HF export every ``save_every`` steps, and the final one) when its length is known in steps."""
    keep = max(1, int(getattr(trainer, "keep_checkpoints", 2)))
    steps, every = int(getattr(trainer, "total_steps", 0)), int(getattr(trainer, "save_every", 0))
    if getattr(trainer, "total_epochs", None) is None and steps > 0:
        keep = min(keep, (steps // every if every > 0 else 0) + 1)
    return keep


def estimate_run_bytes(cfg: ExperimentConfig) -> int:
    """Peak bytes a configured experiment writes (checkpoints dominate; logs are noise)."""
    keep = retained_checkpoints(cfg.trainer)
    with_opt = int(getattr(cfg.trainer, "recover_every", 0)) > 0
    return estimate_checkpoint_bytes(cfg.model, keep, dtype=cfg.engine.dtype, with_optimizer=with_opt)
