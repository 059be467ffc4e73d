"""Device mesh and FSDP2 sharding, kept apart from the model code (torchtitan style).

Mesh layout: ``("dp", "cp")`` with shape ``(dp, cp)``, read from
:class:`~areal_cli.api.parallel_dims.ParallelDims` (order ``"cp-dp"``: cp fastest, so Ulysses peers
are neighbouring ranks), the table the plan prints and placement reads. Parameters are sharded over the flattened
``dp×cp`` ranks (Ulysses ranks hold the same weights, so sharding over them too saves memory), the
data-parallel group is the ``dp`` dim and the Ulysses group is the ``cp`` dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_cli.api.io_struct import ParallelStrategy
from areal_cli.errors import ConfigError

def torch_dtype(name: str, path: str = "engine.dtype"):
    """The torch dtype of a compute-dtype name (:mod:`areal_cli.engines.precision`: float16 is refused)."""
    import torch

    from areal_cli.engines.precision import dtype_name

    return getattr(torch, dtype_name(name, path))


@dataclass
class Meshes:
    """The world mesh and the groups cut from it."""

    mesh: Any  # DeviceMesh ("dp", "cp")
    fsdp_mesh: Any  # 1-D DeviceMesh over dp×cp
    dp_group: Any
    cp_group: Any
    dp_rank: int
    cp_rank: int


def check_strategy(parallel: ParallelStrategy, world_size: int) -> None:
    if parallel.tp != 1 or parallel.pp != 1:
        raise ConfigError("allocation_mode", f"the fsdp engine supports d and c dims only, got t={parallel.tp} "
                          f"p={parallel.pp}", "drop t/p from the fsdp part or use engine=megatron")
    if parallel.dp * parallel.cp != world_size:
        raise ConfigError("allocation_mode", f"fsdp d{parallel.dp}c{parallel.cp} needs {parallel.dp * parallel.cp} "
                          f"processes but the trainer has {world_size}",
                          "make d×c equal to the number of trainer processes")


def build_meshes(parallel: ParallelStrategy, device_type: str, engine: str = "fsdp") -> Meshes:
    """The ``(dp, cp)`` mesh of the fsdp and deepspeed engines (collective: every rank calls it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    check_strategy(parallel, dist.get_world_size())
    names, sizes = parallel.dims(engine).mesh_shape()
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    fsdp_mesh = mesh[names]._flatten("dp_cp")
    return Meshes(mesh=mesh, fsdp_mesh=fsdp_mesh, dp_group=mesh.get_group("dp"), cp_group=mesh.get_group("cp"),
                  dp_rank=mesh.get_local_rank("dp"), cp_rank=mesh.get_local_rank("cp"))


def decoder_layers(model) -> list:
    """The transformer blocks of an HF causal LM (``model.model.layers`` for Qwen2/Llama)."""
    from areal_cli.engines.vision import text_model

    base = text_model(model)  # a VL model's decoder stack sits under model.language_model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError("model.path", f"{type(model).__name__} has no .model.layers",
                          "use a Qwen2/Llama-family decoder model")
    return list(layers)


def embedding_unit(model):
    """The input embedding as an FSDP unit of its own; with a tied head, the two modules as one unit.

    Why: FSDP2 never reshards the root after the forward (the backward would gather it again at once),
    so an embedding left in the root stays gathered from the first layer's forward to the end of the
    backward, and a tied head's unsharded gradient with it: 1 GiB per rank at Qwen2.5-0.5B's
    152k x 896 in fp32. As its own unit it is gathered for the embedding's forward (and, tied, the
    head's forward and backward) and resharded in between, as torchtitan shards ``tok_embeddings``.
    ``None`` when the model has no input embedding module."""
    get_in = getattr(model, "get_input_embeddings", None)
    emb = get_in() if get_in is not None else None
    if emb is None:
        return None
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if get_out is not None else None
    if head is not None and getattr(head, "weight", None) is emb.weight:
        return [emb, head]
    return emb


def apply_fsdp(model, fsdp_mesh, *, param_dtype=None, reduce_dtype=None, extra_modules: tuple = (),
               ignored: tuple = ()) -> None:
    """``fully_shard`` every decoder layer, the extras, the embedding (with a tied head: :func:`embedding_unit`),
    then the root (the final norm and an untied head). ``ignored``: parameters no unit manages (a table
    already row-sharded, engines/sharded_vocab.py); an embedding holding one is no unit of its own.

    Gradients are *summed* over ranks (divide factor 1): the engine already scales every rank's
    loss by its share of the global loss weight, so a mean would divide twice.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    for m in extra_modules:
        fully_shard(m, mesh=fsdp_mesh, mp_policy=mp)
    emb = embedding_unit(model)
    if emb is not None and not any(p is (emb[0] if isinstance(emb, list) else emb).weight for p in ignored):
        fully_shard(emb, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, ignored_params=set(ignored) or None)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has neither AVG nor PREMUL_SUM.
            m.set_force_sum_reduction_for_comms(True)


def set_grad_sync(model, enabled: bool) -> None:
    """Skip (False) or do (True) the gradient reduce-scatter on the next backward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def enable_gradient_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "config"):
        model.config.use_cache = False
