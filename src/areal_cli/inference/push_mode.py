"""Which push mode ``rollout.weight_update`` means for a set of server backends, asked of their specs."""

from __future__ import annotations

from collections.abc import Iterable


def disk_only(backend: str, lora: bool = False) -> bool:
    """Whether ``backend``'s servers take pushes from disk only: they cannot join the trainer's broadcast group
    for full weights, or (``lora``) for an adapter. Asked of the backend's spec (its capability flags)."""
    from areal_cli.inference.backends import backend_spec

    spec = backend_spec(backend)
    return not (spec.lora_broadcast if lora else spec.weight_broadcast)


def resolved_weight_update(mode: str, backends: Iterable[str], lora: bool = False,
                           shared_gpu: bool = False) -> str:
    """The push mode ``rollout.weight_update`` means for these server backends: ``auto`` picks disk where
    any server cannot take the broadcast, or where trainer and servers share GPUs (a colocated plan on
    CUDA: NCCL refuses two ranks of one group on one device), else distributed; an explicit mode is kept
    (validation refuses the combinations that cannot work)."""
    if mode != "auto":
        return mode
    return "disk" if shared_gpu or any(disk_only(b, lora) for b in backends) else "distributed"
