"""Contracts only: small, documented, import-light (no torch at import time)."""

from areal_cli.api.engine_api import TrainEngine
from areal_cli.api.inference_api import InferenceEngine
from areal_cli.api.io_struct import (
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    ParallelStrategy,
    ParamSpec,
    SaveLoadMeta,
    WeightUpdateMeta,
)
from areal_cli.api.weight_receiver import WeightReceiver
from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory

__all__ = [
    "GenerationConfig", "InferenceEngine", "ModelRequest", "ModelResponse", "ParallelStrategy",
    "ParamSpec", "RolloutWorkflow", "SaveLoadMeta", "TrainEngine", "Trajectory", "WeightReceiver",
    "WeightUpdateMeta",
]
