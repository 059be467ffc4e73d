"""Tensor-parallel plans for HF decoder families, applied to the HF module tree from outside.

The model stays the HF module tree (parameter names stay HF names); each plan maps HF module paths
to DTensor parallel styles, as torchtitan's ``parallelize_*`` does for its own model code:

- embeddings: vocab-sharded (``sharded_vocab.shard_embedding``), output sharded on the sequence dim;
- norms: sequence parallel (``SequenceParallel``: each rank normalises its slice of the tokens);
- attention/MLP inputs: gathered over the sequence (``PrepareModuleInput`` ``Shard(1)→Replicate``);
- q/k/v/gate/up ``ColwiseParallel`` (heads / intermediate sharded), o/down ``RowwiseParallel``
  reduce-scattered back onto the sequence dim;
- the final norm's output is gathered to a plain full tensor, so HF's ``logits_to_keep`` slicing and
  indexing work unchanged; ``lm_head`` is vocab-parallel (see :mod:`.vocab_parallel`).

Between blocks the hidden states are DTensors sharded on the sequence dim (global shape), so HF's
model code (mask creation, rotary embeddings) sees the true sequence length. The sequence length of
a forward must be a multiple of ``tp``.

Qwen3's per-head ``q_norm``/``k_norm``: q/k projections keep a DTensor output (sharded on heads), the
norm runs as a sequence-parallel module over the head dim (its weight replicated, its gradient
reduced by DTensor) and hands plain per-rank heads to attention.
"""

from __future__ import annotations

from typing import Any

from areal_cli.errors import ConfigError

# model_type → family key. Qwen2.5 checkpoints are model_type "qwen2"; Qwen2.5-VL's and Qwen2-VL's language
# model is Qwen2's (mrope changes only the rotary tables), and its vision tower is not cut over t
# (engines/vision.py).
FAMILIES = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "qwen2_5_vl": "qwen2", "qwen2_vl": "qwen2"}
SUPPORTED = ("Qwen2/Qwen2.5 (qwen2)", "Qwen3 (qwen3)", "Llama (llama)")

_HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads")
_KV_HEAD_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads")


class NoTensorParallelPlan(ConfigError):
    """The model family has no tensor-parallel plan."""

    def __init__(self, model_type: str):
        self.model_type = model_type
        super().__init__("allocation_mode",
                         f"archon has no tensor-parallel plan for model_type {model_type!r}",
                         f"use t1, or a model of a supported family: {', '.join(SUPPORTED)}")


def model_family(model: Any) -> str:
    """The plan key of ``model`` (an HF causal LM, its base model, or a pipeline stage); raises
    :class:`NoTensorParallelPlan` for families without a plan."""
    cfg = getattr(model, "config", None)
    model_type = str(getattr(cfg, "model_type", "") or type(model).__name__)
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise NoTensorParallelPlan(model_type)
    return fam


def layer_plan(family: str) -> dict[str, Any]:
    """The plan for one decoder block, keyed by module path inside the block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    qk_dtensor = family == "qwen3"  # q/k stay DTensors until the per-head norms
    plan: dict[str, Any] = {
        "input_layernorm": SequenceParallel(),
        # HF calls self_attn with keyword arguments only (hidden_states=..., position_embeddings=...).
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        "self_attn.q_proj": ColwiseParallel(use_local_output=not qk_dtensor),
        "self_attn.k_proj": ColwiseParallel(use_local_output=not qk_dtensor),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    if qk_dtensor:
        # [b, s, heads, head_dim] sharded on heads (dim 2): "sequence parallel" over dim 2 is exactly a
        # replicated-weight norm applied per local head.
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def check_divisible(hf_config: Any, tp: int) -> None:
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads % tp or kv % tp:
        raise ConfigError("allocation_mode", f"t{tp} must divide num_attention_heads={heads} and "
                          f"num_key_value_heads={kv}", "pick t that divides both head counts")


def _adjust_head_counts(attn: Any, tp: int) -> None:
    """HF 5.x attention infers the head count from the projection's output (``view(..., -1, d)``);
    older and third-party variants keep counts as attributes, which must become per-rank counts."""
    for attr in _HEAD_COUNT_ATTRS + _KV_HEAD_COUNT_ATTRS:
        v = getattr(attn, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(attn, attr, v // tp)
    hidden = getattr(attn, "hidden_size", None)
    if isinstance(hidden, int) and not isinstance(hidden, bool) and hasattr(attn, "num_heads"):
        setattr(attn, "hidden_size", hidden // tp)


def apply_tp(model: Any, tp_mesh: Any, *, vocab_parallel: bool = True, vocab: bool = True) -> None:
    """Apply the family's plan to ``model`` in place.

    ``model`` is an HF causal LM (``.model`` base + ``.lm_head``) or a pipeline stage of one (same
    attribute names; missing embeddings, skipped layers, or a missing head are left alone). No-op
    when the mesh has one rank. Tied embeddings are re-tied after sharding (both are vocab-sharded
    the same way, ``Shard(0)`` of ``[V, H]``). ``vocab_parallel=False`` leaves ``lm_head`` whole on
    every rank (a critic's 1-wide value head; its gradients are then identical on all tp ranks).
    ``vocab=False`` leaves the embedding and the head alone (a tied table row-sharded over every rank,
    engines/sharded_vocab.py, makes the same sequence-sharded embedding output).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleOutput, SequenceParallel,
                                                   parallelize_module)

    from areal_cli.engines import sharded_vocab
    from areal_cli.engines.archon import vocab_parallel as vp

    from areal_cli.engines.vision import text_config, text_model

    family = model_family(model)
    tp = tp_mesh.size()
    if tp == 1:
        return
    check_divisible(text_config(model.config), tp)
    base = text_model(model)
    lm_head = getattr(model, "lm_head", None)
    tied = (lm_head is not None and getattr(base, "embed_tokens", None) is not None
            and lm_head.weight is base.embed_tokens.weight)
    if tied and not vocab_parallel:
        raise ConfigError("model.path",
                          "tied embeddings need the vocab-parallel lm_head under tensor parallelism",
                          "keep vocab_parallel=True, or untie the head first")
    if getattr(base, "embed_tokens", None) is not None and vocab:
        # Global-shape DTensor out (HF builds masks and rotary embeddings from inputs_embeds' shape), the
        # gradient the weight's own shard
        sharded_vocab.shard_embedding(base.embed_tokens, tp_mesh)
    plan = layer_plan(family)
    for layer in base.layers:
        if not any(True for _ in layer.parameters()):
            continue  # a layer another pipeline stage owns
        parallelize_module(layer, tp_mesh, plan)
        _adjust_head_counts(layer.self_attn, tp)
    if _has_params(getattr(base, "norm", None)):
        parallelize_module(base.norm, tp_mesh, SequenceParallel())
        parallelize_module(base.norm, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                   desired_output_layouts=Replicate(),
                                                                   use_local_output=True))
    if lm_head is not None and vocab_parallel and vocab:
        parallelize_module(lm_head, tp_mesh, vp.lm_head_style())
        if tied:
            lm_head.weight = base.embed_tokens.weight


def _has_params(module: Any) -> bool:
    return module is not None and any(True for _ in module.parameters())
