"""wandb logging in offline mode (no network): the real wandb client writes a local run that holds our metrics."""

from __future__ import annotations

import json
import time

import pytest

from areal_cli.config.trainer import StatsConfig
from areal_cli.errors import ConfigError


def test_wandb_offline_run_records_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from areal_cli.trainer.stats import StatsLogger

    cfg = StatsConfig(tensorboard=False, wandb=True, wandb_mode="offline", wandb_project="areal-test")
    logger = StatsLogger(str(tmp_path), cfg, experiment="exp", trial="t0", config={"seed": 3})
    assert logger._wandb is not None and logger._wandb.settings.mode == "offline"
    for step in (1, 2, 3):
        logger.log("train", step, {"reward/mean": 0.25 * step, "note": "not numeric"})
    run_dir = logger._wandb.dir
    logger.close()
    # metrics.jsonl is still written alongside wandb.
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in recs] == [0.25, 0.5, 0.75]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), "no offline wandb run was written"
    # The run file (what `wandb sync` uploads later) carries our key and the last value.
    # wandb's service process may still be flushing the file when finish() returns on a busy machine.
    deadline = time.monotonic() + 30
    blob = next(runs[0].glob("run-*.wandb")).read_bytes()
    while b"0.75" not in blob and time.monotonic() < deadline:
        time.sleep(0.2)
        blob = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"reward/mean" in blob and b"0.75" in blob and b"not numeric" not in blob
    assert wandb.run is None and run_dir


def test_unknown_wandb_mode_is_a_config_error(tmp_path):
    pytest.importorskip("wandb")
    from areal_cli.trainer.stats import StatsLogger

    with pytest.raises(ConfigError) as e:
        StatsLogger(str(tmp_path), StatsConfig(tensorboard=False, wandb=True, wandb_mode="cloudy"))
    assert e.value.path == "stats.wandb_mode"
