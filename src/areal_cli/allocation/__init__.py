"""The allocation_mode language: parser, typed spec, placement, constraint checks, memory estimate."""

from areal_cli.allocation.parser import parse_allocation
from areal_cli.allocation.spec import (
    INFERENCE_BACKENDS,
    TRAIN_BACKENDS,
    AllocationSpec,
    Component,
    Dims,
)

__all__ = ["INFERENCE_BACKENDS", "TRAIN_BACKENDS", "AllocationSpec", "Component", "Dims",
           "parse_allocation"]
