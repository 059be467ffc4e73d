"""Gradient-norm clipping over parameters on several meshes (plain tensors, TP DTensors, FSDP×TP
DTensors) and, under pipelining, over several ranks' disjoint stages.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails on this mix ("got
mixed torch.Tensor and DTensor", "must have the same mesh"). Here the norm is taken per mesh (a
DTensor norm reduces over its own mesh), the per-mesh norms are combined, and under PP the partial
result is all-reduced over the pipeline group (every stage holds different parameters).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from areal_cli.utils import collectives


def _mesh_key(g: torch.Tensor) -> Any:
    mesh = getattr(g, "device_mesh", None)
    if mesh is None:
        return None
    # Two DeviceMesh objects over the same ranks and dims are the same mesh.
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), mesh.mesh_dim_names)


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    # one mesh's gradients (foreach needs them on one mesh, which is what the grouping is for)
    n = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True)
    if hasattr(n, "full_tensor"):
        n = n.full_tensor()
    return n.detach().to(torch.float64).cpu()


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *,
                    pp_group: Any = None) -> torch.Tensor:
    """The norm of all gradients of ``parameters`` together (a float64 CPU scalar, equal on every
    rank). Pass each pipeline stage's parameters exactly once (leave out a tied copy)."""
    norm_type = float(norm_type)
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p.grad), []).append(p.grad)
    inf = math.isinf(norm_type)
    acc = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        n = _local_norm(grads, norm_type)
        acc = torch.maximum(acc, n) if inf else acc + n ** norm_type
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        op = collectives.ReduceOp.MAX if inf else collectives.ReduceOp.SUM
        collectives.all_reduce(acc, op=op, group=pp_group)
    return acc if inf else acc ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                    pp_group: Any = None, norm_parameters: Iterable[torch.Tensor] | None = None) -> float:
    """Scale the gradients of ``parameters`` so their total norm is at most ``max_norm``; returns the
    total norm before clipping (``inf``/``nan`` as computed: the caller decides to skip the step).

    ``norm_parameters`` (default: ``parameters``) are the ones whose gradients count towards the
    norm: under PP with tied embeddings, the last stage's copy of the embedding is scaled but not
    counted. Same coefficient as torch's: ``min(1, max_norm / (norm + 1e-6))``.
    """
    params = [p for p in parameters if p.grad is not None]
    counted = params if norm_parameters is None else list(norm_parameters)
    total = float(total_grad_norm(counted, norm_type, pp_group=pp_group))
    if not math.isfinite(max_norm) or not math.isfinite(total):
        return total
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            grads: dict[Any, list[torch.Tensor]] = {}
            for p in params:  # _foreach_mul_ takes one mesh's DTensors (or plain tensors) at a time
                grads.setdefault((_mesh_key(p.grad), p.grad.device, p.grad.dtype), []).append(p.grad)
            for gs in grads.values():
                torch._foreach_mul_(gs, coef)
    return total

