"""Learning-rate schedules (constant, linear, cosine; each with linear warmup) and AdamW setup."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.algo import OptimConfig

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    if kind not in SCHEDULES:
        raise ConfigError("algo.optim.lr_scheduler", f"unknown schedule {kind!r}", f"use one of {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    if kind == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def foreach_ok(tensors) -> bool:
    """Whether torch's foreach (multi-tensor) path can take ``tensors`` as one list: plain tensors only,
    or DTensors of one mesh only (any placements; tests/integration/engines/test_host_syncs.py).

    Foreach runs one kernel per dtype/device group instead of one per parameter and op, but a list mixing
    plain tensors and DTensors, or DTensors of several meshes (archon: TP-planned and FSDP-only modules,
    expert meshes), fails in DTensor's dispatch ("got mixed torch.Tensor and DTensor"); those keep the
    per-parameter loop (archon's clip groups by mesh itself: engines/archon/clip.py)."""
    kinds = set()
    for t in tensors:
        mesh = getattr(t, "device_mesh", None)
        kinds.add(None if mesh is None else (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape),
                                             mesh.mesh_dim_names))
        if len(kinds) > 1:
            return False
    return True


def _fusable(params) -> bool:
    params = list(params)
    return foreach_ok(params) and all(p.dtype.is_floating_point for p in params)


def fuse_adam(optimizer) -> int:
    """Switch torch Adam/AdamW optimizers built elsewhere (megatron-core builds torch's AdamW with the
    per-parameter loop on a host without TransformerEngine or apex) to the fused kernel where their
    parameters allow it, before their first step; walks mcore's wrappers (``.optimizer``,
    ``.chained_optimizers``). Returns how many optimizers it switched."""
    import torch

    inner = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    switched = 0
    for opt in inner:
        opt = getattr(opt, "optimizer", opt) if not isinstance(opt, torch.optim.Optimizer) else opt
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state:
            continue
        if not all(_fusable(g["params"]) and not g.get("differentiable") for g in opt.param_groups):
            continue
        for g in opt.param_groups:
            g["fused"], g["foreach"] = True, False
        switched += 1
    return switched


# the hyper-parameters of a main group that AdamW takes (a group also holds params, the schedule's initial_lr)
ADAMW_ARGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
              "differentiable", "fused")


def adamw_like(params, group: dict):
    """A ``torch.optim.AdamW`` over ``params`` with the implementation and hyper-parameters of the main
    optimizer's ``group``: for rows an engine steps apart from it (a tied table's), so they take the same
    update. Call :func:`follow` before each step for the schedule's learning rate."""
    import torch

    return torch.optim.AdamW(list(params), **{k: v for k, v in group.items() if k in ADAMW_ARGS})


def follow(opt, group: dict) -> None:
    """``opt``'s group takes ``group``'s current hyper-parameters (the schedule's lr for this step)."""
    opt.param_groups[0].update({k: v for k, v in group.items() if k in ADAMW_ARGS})


def build_optimizer(params, optim_cfg: OptimConfig, total_steps: int):
    """AdamW + LambdaLR from an :class:`~areal_cli.config.algo.OptimConfig`."""
    import torch

    params = list(params)

    if optim_cfg.lr <= 0:
        raise ConfigError("algo.optim.lr", f"must be positive, got {optim_cfg.lr}", "set e.g. algo.optim.lr=1e-5")
    if optim_cfg.warmup_steps < 0:
        raise ConfigError("algo.optim.warmup_steps", "must be >= 0", "set algo.optim.warmup_steps=0")
    lr_factor(0, kind=optim_cfg.lr_scheduler, warmup_steps=0, total_steps=1)  # validates the name
    # Fused where the list allows one kernel (foreach_ok): the same update in place, where foreach makes a
    # temporary the size of every parameter (measured: +0.50 GiB at the step on 0.5 GiB of fp32 parameters,
    # fused +0.00; a per-parameter loop +0.19). The step peak of a sharded engine is this step.
    one_list = _fusable(params)
    opt = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
                            weight_decay=optim_cfg.weight_decay, fused=True if one_list else None,
                            foreach=None if one_list else False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(
        s, kind=optim_cfg.lr_scheduler, warmup_steps=optim_cfg.warmup_steps, total_steps=max(1, total_steps),
        min_lr_ratio=optim_cfg.min_lr_ratio))
    return opt, sched
