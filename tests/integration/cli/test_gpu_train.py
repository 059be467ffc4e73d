"""`areal train cluster.device=cuda` on one GPU, colocated (`hf:d1|d1`: the hf server and the trainer share
device 0), a few steps with the weights pushed to the server after each (scripts/gpu_check.sh;
docs/gpu_check.md).

Both ways of asking run. ``auto`` must resolve to disk here (config/rollout.py resolved_weight_update): a
broadcast would put the trainer and the server, on one GPU, in one NCCL group, which NCCL refuses; ``disk``
is the explicit form. Each writes and reloads a checkpoint per step.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from gpu_check import DEVICE, REHEARSING, needs_cuda, record
from train_runs import _env, _overrides, _records

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.timeout(900)]

STEPS = 3


@pytest.mark.parametrize("weight_update", ["auto", "disk"])
def test_colocated_one_gpu_run(tmp_path, tiny_model_dir, weight_update):
    args = _overrides(tmp_path, tiny_model_dir, **{
        "cluster.device": DEVICE, "cluster.n_gpus_per_node": 1, "allocation_mode": "hf:d1|d1",
        "rollout.weight_update": weight_update, "trainer.total_steps": STEPS, "trainer.recover_every": 0,
        "trainer.save_every": 0, "trainer.eval_every": 0})
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], capture_output=True,
                         text=True, env=_env(), timeout=800)
    out = (res.stdout + res.stderr)[-4000:]
    run_dir = tmp_path / "runs" / "itest" / "t0"
    steps = [r for r in _records(run_dir) if r["kind"] == "train"]
    record(f"train_colocated_{weight_update}", {
        "returncode": res.returncode, "steps": [{k: r.get(k) for k in (
            "step", "version", "weight_sync/disk", "perf/weight_sync_s", "perf/step_s", "reward/mean")}
            for r in steps], "output_tail": out if res.returncode else ""}, tmp_path)
    assert res.returncode == 0, out
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), out
    for r in steps:  # every step pushed its weights
        assert r["version"] == r["step"]
        assert r["perf/weight_sync_s"] > 0
        # auto resolves to disk on a shared GPU; the CPU rehearsal has no NCCL to refuse a shared device, and
        # there auto broadcasts over gloo (config/rollout.py resolved_weight_update)
        want = 0.0 if REHEARSING and weight_update == "auto" else 1.0
        assert r["weight_sync/disk"] == want, r
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
