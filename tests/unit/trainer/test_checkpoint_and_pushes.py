"""One disk-push directory scheme for every trainer push, and RNG state restored once on resume."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from areal_cli.trainer.checkpoint import CheckpointManager
from areal_cli.weight_sync.disk_layout import (
    disk_update_meta,
    load_meta,
    prune_pushed,
    pushed_dirs,
    versioned_dir,
)


def test_every_disk_push_of_a_run_lands_in_run_dir_weight_sync_v_version(tmp_path):
    meta = disk_update_meta(str(tmp_path), 7)
    assert (meta.type, meta.version, meta.path) == ("disk", 7, str(tmp_path / "weight_sync"))
    # what a sender writes and what the trainer's own engine.save writes are the same dir
    assert load_meta(meta).path == versioned_dir(meta.path, 7) == str(tmp_path / "weight_sync" / "v7")


def test_pruning_keeps_the_newest_versions_by_number(tmp_path):
    root = tmp_path / "weight_sync"
    for v in (9, 10, 11, 2):
        Path(versioned_dir(str(root), v)).mkdir(parents=True)
    (root / "stray").mkdir()  # not a push: left alone
    assert [p.name for p in pushed_dirs(str(root))] == ["v2", "v9", "v10", "v11"]
    prune_pushed(str(root), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["stray", "v10", "v11"]
    prune_pushed(str(tmp_path / "missing"), keep=1)  # nothing pushed yet


class _Engine:
    """Records save/load calls; an engine's checkpoint holds no RNG state."""

    def __init__(self):
        self.calls: list[str] = []

    def save(self, meta):
        self.calls.append(f"save:{meta.weight_format}")

    def load(self, meta):
        self.calls.append(f"load:{meta.weight_format}")


def test_resume_restores_each_ranks_rng_from_the_checkpoint(tmp_path):
    ckpt = CheckpointManager(str(tmp_path), rank=0)
    random.seed(1)
    torch.manual_seed(1)
    path = ckpt.save_recover(_Engine(), 3, {"step": 3}, {"critic": _Engine()})
    expected = (random.random(), torch.rand(3))
    random.seed(99)  # the resumed process starts from another state (model init draws, seeding)
    torch.manual_seed(99)
    engine, critic = _Engine(), _Engine()
    state = ckpt.load_recover(engine, Path(path), {"critic": critic})
    assert state == {"step": 3} and engine.calls == ["load:dcp"] and critic.calls == ["load:dcp"]
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
