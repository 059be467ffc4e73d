"""Apply Archon's parallelisms to an HF causal LM or to one pipeline stage of it, in torchtitan's
order: tensor parallel → expert parallel (MoE models) → activation checkpointing → FSDP2.

TP first, because FSDP2 shards the TP DTensors once more over the ``dp×cp`` mesh (2-D parameters);
checkpointing before FSDP, so the recompute sits inside the FSDP unit and re-uses its gathered
parameters. Checkpointing uses HF's own per-layer hook (``GradientCheckpointingLayer``) rather than
torch's ``checkpoint_wrapper``, which would rename every parameter.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from areal_cli.engines.archon import expert_parallel, tp_plans
from areal_cli.engines.archon.mesh import ArchonMesh


def _owned_layers(model: nn.Module) -> list[nn.Module]:
    """Decoder layers that hold parameters (a pipeline stage skips the others)."""
    from areal_cli.engines.vision import text_model

    return [layer for layer in text_model(model).layers if any(True for _ in layer.parameters())]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant checkpoint, parameter names kept)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn = functools.partial(checkpoint, use_reentrant=False)
    for layer in _owned_layers(model):
        if not isinstance(layer, GradientCheckpointingLayer):
            raise TypeError(f"{type(layer).__name__} is not an HF GradientCheckpointingLayer")
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = fn
    if hasattr(model, "config"):
        model.config.use_cache = False


def apply_fsdp(model: nn.Module, fsdp_mesh: Any, *, param_dtype=None, reduce_dtype=None,
               reshard_after_forward: bool = True, efsdp_mesh: Any = None, unmanaged: tuple = ()) -> None:
    """``fully_shard`` every owned decoder layer, then the root (embeddings, final norm, head).

    Gradients are summed over ranks (divide factor 1, plain SUM collectives as gloo has no AVG):
    the engine scales each micro-batch loss by its share of the global weight already.
    Under pipelining pass ``reshard_after_forward=False``: several micro-batches run forward
    before their backward, and re-gathering the parameters for each would multiply the traffic.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in _owned_layers(model):
        ignored = None
        experts = _ep_experts(layer)
        if experts is not None and efsdp_mesh is not None and efsdp_mesh.size() > 1:
            # experts: their own unit over the efsdp ranks (2-D with the ep mesh), before the layer's
            fully_shard(experts, mesh=efsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=functools.partial(_expert_placement, efsdp_mesh.size()))
        elif experts is not None:  # e = d×c: each expert lives on one rank, nothing to shard further
            ignored = set(experts.parameters())
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored)
    from areal_cli.engines.vision import tower_units

    for unit in tower_units(model):  # a VL model's ViT blocks, then the rest of its tower (not cut over t)
        fully_shard(unit, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                ignored_params=set(unmanaged) or None)  # a row-sharded tied table (engines/sharded_vocab.py)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _ep_experts(layer: nn.Module) -> nn.Module | None:
    """The layer's expert module when its experts are cut over ep (DTensors), else None."""
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, expert_parallel.MoEBlock) and mlp.ep_size > 1:
        return mlp.experts
    return None


def _expert_placement(efsdp: int, param: nn.Parameter):
    """FSDP's shard dim for an expert tensor (torchtitan's rule): the expert dim while it divides over
    the efsdp ranks, else the next one."""
    from torch.distributed.tensor import Shard

    local_experts = param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]
    return Shard(0) if local_experts % efsdp == 0 else Shard(1)


def parallelize(model: nn.Module, mesh: ArchonMesh, *, activation_checkpointing: bool = False,
                param_dtype=None, reduce_dtype=None, vocab_parallel: bool = True,
                pipelined: bool = False, force_fsdp: bool = False, table: Any = None) -> nn.Module:
    """TP → activation checkpointing → FSDP2 on ``model`` (in place; returned for chaining).

    ``model``: an HF causal LM or a :class:`~.pipeline.StageModule`. FSDP is skipped when ``dp×cp``
    is one rank and no mixed precision is asked (as torchtitan: nothing to shard, and FSDP's hooks
    cost time), unless ``force_fsdp``. ``table``: the model's tied table already row-sharded over every
    rank (engines/sharded_vocab.py): neither TP nor FSDP touch the embedding and the head then.
    """
    from areal_cli.engines.archon.pipeline import StageModule

    if mesh.dims.tp > 1:
        tp_plans.apply_tp(model, mesh.tp_mesh, vocab_parallel=vocab_parallel, vocab=table is None)
        if isinstance(model, StageModule):
            model.seq_mesh = mesh.tp_mesh  # hidden states between stages are sequence slices
    hf_config = getattr(model, "config", None)
    if hf_config is not None and expert_parallel.is_moe_config(hf_config):
        expert_parallel.apply_moe(model, hf_config, mesh.ep_mesh)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    mixed = param_dtype is not None or reduce_dtype is not None
    if mesh.fsdp_mesh.size() > 1 or mixed or force_fsdp:
        apply_fsdp(model, mesh.fsdp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=not pipelined, efsdp_mesh=mesh.efsdp_mesh,
                   unmanaged=() if table is None else (table.weight,))
    return model
