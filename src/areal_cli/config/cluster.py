"""``cluster`` group: the hardware the allocation is placed on."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.ranges import ranged

# The closed value sets of this group's string fields, written once: validation (plan/validate.py) and the
# field comments refer to them. Plain str fields, not Literal: OmegaConf 2.3's structured configs reject
# Literal annotations.
DEVICES = ("cpu", "cuda")


@dataclass
class ClusterConfig:
    n_nodes: int = ranged(1, ge=1)
    n_gpus_per_node: int = ranged(2, ge=1)  # on cpu: processes ("devices") per node
    device: str = "cpu"  # one of DEVICES
    # What one device can do, for the memory estimate and `areal plan`: a built-in profile (h100 h200 a100 b200
    # l40s cpu), one saved by `areal plan --calibrate`, or a path to a profile .json; auto = cpu on
    # cluster.device=cpu, else h100 (allocation/hardware.py).
    hardware: str = "auto"
    # None = the hardware profile's memory; a value here wins (a GPU variant the profile does not describe).
    gpu_memory_gb: float | None = ranged(None, gt=0.0, le=1e5, why="the GPU's memory in GB")
    fileroot: str = "~/.cache/areal"


