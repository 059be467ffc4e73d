"""Stats loggers on trainer rank 0: ``metrics.jsonl`` and tensorboard always, wandb when configured.

Every record is one JSON line ``{"kind": "train"|"eval"|"sft"|"event", "step": N, "time": t, ...}``
with flat ``group/name`` keys. ``metrics.jsonl`` is the source of truth: the live view in the CLI
process tails it, the summary table and the learning curve are drawn from it, and resume truncates
it back to the recovered step so a resumed run's file reads like an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.trainer import StatsConfig

METRICS_FILE = "metrics.jsonl"
# Record fields that are bookkeeping, not curves: never sent to tensorboard or wandb. ``total`` is the
# step count of the record's phase (SFT records carry it: the live view's step/total and ETA).
NOT_SCALARS = ("step", "time", "total")


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class StatsLogger:
    """Writes metrics on the logging rank; a no-op elsewhere."""

    def __init__(self, run_dir: str, stats_cfg: StatsConfig, *, experiment: str = "areal",
                 trial: str = "default", config: dict | None = None, enabled: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if stats_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # The writer's own thread flushes every few seconds (and on close): a flush per step
            # would make the training loop wait for the event file's disk write.
            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"), flush_secs=5)
        if stats_cfg.wandb:
            self._wandb = _init_wandb(run_dir, stats_cfg, experiment, trial, config)

    def truncate_after(self, step: int, kinds: tuple[str, ...] = ("train", "eval")) -> None:
        """Drop the ``kinds`` records past ``step``: the steps a resumed run does again. Other kinds stay (an
        RL run's SFT warm-start records count their own steps, and the warm start is not redone)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line from a killed run
            if rec.get("kind") not in kinds or int(rec.get("step", 0)) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.path)

    def log(self, kind: str, step: int, stats: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), "time": time.time()}
        rec.update({k: _clean(v) for k, v in stats.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        numeric = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k not in NOT_SCALARS}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(f"{kind}/{k}" if "/" not in k else k, v, global_step=step)
        if self._wandb is not None:
            self._wandb.log({(f"{kind}/{k}" if "/" not in k else k): v for k, v in numeric.items()},
                            step=int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _init_wandb(run_dir: str, stats_cfg: StatsConfig, experiment: str, trial: str,
                config: dict | None) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("stats.wandb", "wandb logging is on but wandb is not installed",
                          "pip install 'areal-cli[wandb]' or set stats.wandb=false") from e
    mode = stats_cfg.wandb_mode
    if mode not in ("offline", "online", "disabled"):
        raise ConfigError("stats.wandb_mode", f"unknown mode {mode!r}", "use offline, online or disabled")
    return wandb.init(project=stats_cfg.wandb_project, name=f"{experiment}/{trial}", dir=run_dir,
                      mode=mode, config=config or {}, resume="allow", id=f"{experiment}-{trial}")


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of ``<run_dir>/metrics.jsonl`` (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
