"""The allocation_mode language: parser, typed spec, placement, constraint checks, memory estimate."""

from areal_cli.allocation.parser import parse_allocation
from areal_cli.allocation.spec import (
    AllocationSpec,
    Component,
    Dims,
    inference_backends,
    train_backends,
)

__all__ = ["AllocationSpec", "Component", "Dims", "inference_backends", "parse_allocation", "train_backends"]
