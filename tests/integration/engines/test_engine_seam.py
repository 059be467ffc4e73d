"""The engine seam end to end: a plugin engine named by import path trains in the torchrun children,
and episodes are split by data-parallel rank (a d1c2 run trains every episode on both ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support_paths import SUPPORT

pytestmark = pytest.mark.timeout(400)
HERE = SUPPORT


@pytest.mark.parametrize("engine", ["RecordingEngine", "RecordingArchon"], ids=["fsdp", "archon"])
def test_plugin_engine_at_d1c2_trains_every_episode(tiny_model_dir, tmp_path, engine):
    record = tmp_path / "trained.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "AREAL_TEST_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    steps, batch, group = 2, 2, 2
    args = {"cluster.fileroot": tmp_path, "model.path": tiny_model_dir, "experiment_name": "seam",
            "trial_name": "c2", "allocation_mode": "hf:d1+d1c2", "engine.name": f"plugin_engine:{engine}",
            "trainer.total_steps": steps, "trainer.sft_warmup_steps": 0, "trainer.eval_every": 0,
            "trainer.recover_every": 0, "trainer.save_every": 0, "algo.batch_size": batch,
            "rollout.group_size": group, "rollout.gconfig.max_new_tokens": 6, "dataset.train_size": 50,
            "dataset.test_size": 4, "dataset.max_prompt_len": 256, "stats.live": "false",
            "cluster.n_gpus_per_node": 3}
    p = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *(f"{k}={v}" for k, v in args.items())],
                       capture_output=True, text=True, env=env, timeout=380)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    trained = [json.loads(line) for line in record.read_text().splitlines()]
    metrics = [json.loads(line) for line in (tmp_path / "runs/seam/c2/metrics.jsonl").read_text().splitlines()]
    steps_rec = [m for m in metrics if m.get("kind") == "train"]
    assert len(steps_rec) == steps
    by_rank = {r: [t for t in trained if t["rank"] == r] for r in (0, 1)}
    assert all(len(v) == steps for v in by_rank.values()), trained  # the plugin ran in both children
    for i, m in enumerate(steps_rec):
        gen_tokens = m["gen/mean_len"] * batch * group  # loss tokens = generated tokens in rlvr
        for r in (0, 1):
            got = by_rank[r][i]
            assert got["dp_rank"] == 0 and got["rows"] == batch * group, got  # the whole batch, not half
            assert got["tokens"] == pytest.approx(gen_tokens), (got, m)
