"""The resolved experiment config on disk: what the CLI writes and every trainer rank reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


def save_config(cfg: ExperimentConfig, path: str | os.PathLike) -> str:
    """Write ``cfg`` (an ExperimentConfig) as YAML, atomically."""
    from omegaconf import OmegaConf

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    os.replace(tmp, p)
    return str(p)


def load_config_file(path: str | os.PathLike) -> ExperimentConfig:
    """Read a YAML written by :func:`save_config` back into a typed ExperimentConfig."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from areal_cli.config.schema import ExperimentConfig

    if not Path(path).is_file():
        raise ConfigError("--config", f"config file {path} does not exist",
                          "start runs with `areal train`, which writes <run_dir>/config.yaml")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), OmegaConf.load(str(path)))
    except OmegaConfBaseException as e:
        raise ConfigError(getattr(e, "full_key", "") or "--config", f"invalid config file {path}: {e}",
                          "re-create it with `areal train`") from e
    cfg = OmegaConf.to_object(merged)
    # The plugins register names this process will look up (trainer ranks under any launcher,
    # even one that does not pass AREAL_PLUGINS on).
    from areal_cli.registry import load_plugins

    load_plugins(cfg.plugins)
    return cfg
