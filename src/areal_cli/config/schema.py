"""The top-level experiment config: one field per config group.

Group modules (algo.py, engine.py, ...) define each group's dataclass; this module composes them.
``areal_cli.plan.compose`` registers these in Hydra's ConfigStore and turns overrides into a
typed :class:`ExperimentConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged

from areal_cli.config.algo import AlgoConfig
from areal_cli.config.allocation import AllocationModeConfig
from areal_cli.config.cluster import ClusterConfig
from areal_cli.config.dataset import DatasetConfig
from areal_cli.config.engine import EngineConfig
from areal_cli.config.launcher import LauncherConfig
from areal_cli.config.model import ModelConfig
from areal_cli.config.rollout import RolloutConfig
from areal_cli.config.trainer import StatsConfig, TrainerConfig
from areal_cli.config.workflow import WorkflowConfig


@dataclass
class ExperimentConfig:
    experiment_name: str = "areal"
    # Empty: `areal train` names the run by its start time (YYYYMMDD-HHMMSS), and resume=auto continues
    # the experiment's latest run (cli/resume.py).
    trial_name: str = ""
    seed: int = ranged(1, ge=0, le=2**32 - 1)
    # none | auto (continue the latest recover state in the run dir; refused when a setting the checkpoint
    # depends on changed) | force (auto without that check) | <path to a recover dir>
    resume: str = "none"
    skip_storage_check: bool = False
    # Modules imported before validation and in every process of the run; they register advantage
    # estimators, policy losses, rewards or workflows (docs/architecture.md, "Registries and plugins").
    plugins: list[str] = field(default_factory=list)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    allocation_mode: AllocationModeConfig = field(default_factory=AllocationModeConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)

    def run_dir(self) -> str:
        """``<fileroot>/runs/<experiment_name>/<trial_name>`` with ``~`` expanded."""
        import os

        return os.path.join(os.path.expanduser(self.cluster.fileroot), "runs", self.experiment_name,
                            self.trial_name)
