"""Whether a plan runs on this machine, or is being drawn up here for other machines.

``validate-config`` plans GPU clusters from a laptop: the data files, the model and the engine packages of
such a plan live on the cluster's nodes, so what this machine lacks is a plan warning there, not an error.
A plan runs here when its launcher is ``local`` and its device is one this machine has (``cpu`` always;
``cuda`` when an NVIDIA driver is loaded). ``areal train`` with ``launcher=local`` re-checks everything at
launch, where nothing is excused. Torch-free: a driver file, not ``torch.cuda``, tells.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


@functools.lru_cache(maxsize=1)
def has_cuda_driver() -> bool:
    """An NVIDIA kernel driver is loaded (what CUDA needs), read from /proc without importing torch."""
    return os.path.exists("/proc/driver/nvidia/version")


def runs_here(cfg: ExperimentConfig) -> bool:
    """True when this machine is where the plan's processes would start."""
    if cfg.launcher.name != "local":
        return False
    return cfg.cluster.device != "cuda" or has_cuda_driver()


def where_it_runs(cfg: ExperimentConfig) -> str:
    """Words for the warning: where the plan's processes run instead of here."""
    if cfg.launcher.name != "local":
        return f"launcher={cfg.launcher.name} runs it on the cluster's nodes"
    return "the plan is for GPU nodes (cluster.device=cuda; this machine has no NVIDIA driver)"
