"""Exact resume in synchronous mode: kill -9 the trainer mid-run, resume, and the final weights are
bit-identical to an uninterrupted run with the same seed.

What makes it exact: the prompt stream restarts at the recovered position, batches are ordered by
prompt position, every sampling request carries a seed derived from (run seed, prompt position,
request index) so the server draws the same tokens however requests are batched, the engine restores
model, optimizer, scheduler and RNG, and the PPO ratio uses trainer-recomputed log-probs.

The server here takes one request at a time (``--max-running-requests 1``). Its logits for a request
depend, in the last bits, on the requests batched with it (measured: logprobs differ by up to 1e-6
between a request served alone and among 40 others; docs/train.md, "Checkpoints and resume"), so at a
near-tie two runs with the same seed can sample differently before any kill. One request at a time
removes that, and what the test compares is the trainer's resume alone.
Slow: `pytest -m slow tests/integration/cli/test_train_exact_resume.py`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from train_runs import _env_with_reward, _overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SYNC = {"trainer.total_steps": 6, "rollout.max_head_offpolicyness": 0, "trainer.recover_every": 2,
        "trainer.save_every": 0, "trainer.eval_every": 0, "algo.recompute_logprob": "true",
        "rollout.gconfig.max_new_tokens": 8, "dataset.test_size": 4,
        "workflow.reward": "resume_reward.varied_reward",
        "launcher.server_args": "[--max-running-requests,1]"}


def _train(root, model_dir, env, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train",
                           *_overrides(root, model_dir, **{**SYNC, **extra})],
                          capture_output=True, text=True, env=env, timeout=600)


def torch_equal(a, b) -> bool:
    return bool((a == b).all()) and a.shape == b.shape


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


LAYOUTS = {"fsdp": {}, "archon_d1t2": {"engine": "archon", "allocation_mode": "hf:d1+d1t2",
                                       "cluster.n_gpus_per_node": 3},
           "megatron_d1t2": {"engine": "megatron", "allocation_mode": "hf:d1+d1t2", "cluster.n_gpus_per_node": 3},
           "deepspeed_z3_d2": {"engine": "deepspeed", "allocation_mode": "hf:d1+d2", "cluster.n_gpus_per_node": 3},
           # LoRA: the recover checkpoint holds the adapter and optimizer only; the final adapter must match.
           "fsdp_lora": {"model.lora.rank": 8, "algo.optim.lr": 1e-3}}


def _first_difference(ref_dir, cut_dir) -> str:
    """Where the two runs' training steps first differ (a step before the kill: not the resume)."""
    from train_runs import _records

    steps = [{r["step"]: r for r in _records(d) if r.get("kind") == "train"} for d in (ref_dir, cut_dir)]
    for step in sorted(steps[0]):
        x, y = steps[0][step], steps[1].get(step, {})
        keys = [k for k in x if not k.startswith(("time", "perf", "timing")) and x.get(k) != y.get(k)]
        if keys:
            diffs = ", ".join(f"{k} {x.get(k)} vs {y.get(k)}" for k in keys[:4])
            return f"first differing step {step}: {diffs}"
    return "the logged steps agree"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kill9_and_resume_is_bit_identical(tmp_path, tiny_model_dir, layout):
    ref_root, cut_root = tmp_path / "ref", tmp_path / "cut"
    env = _env_with_reward(tmp_path)
    lay = LAYOUTS[layout]
    ref = _train(ref_root, tiny_model_dir, env, **lay)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]

    run_dir = cut_root / "runs" / "itest" / "t0"
    proc = subprocess.Popen([sys.executable, "-m", "areal_cli.cli.main", "train",
                             *_overrides(cut_root, tiny_model_dir, **{**SYNC, **lay})], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    deadline = time.time() + 400
    while not (run_dir / "recover" / "latest.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    pid = int(re.search(r"trainer rank 0/\d+ pid (\d+)", (run_dir / "logs" / "trainer_rank0.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "SIGKILL" in out, out[-3000:]
    recovered = json.loads((run_dir / "recover" / "latest.json").read_text())["step"]
    assert recovered in (2, 4)

    res = _train(cut_root, tiny_model_dir, env, resume="auto", **lay)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    a, b = _weights(ref_root / "runs" / "itest" / "t0"), _weights(run_dir)
    assert a.keys() == b.keys()
    differing = [k for k in a if not (a[k] == b[k]).all()]
    assert not differing, (f"weights differ after resume from step {recovered}: {differing[:5]}; "
                           f"{_first_difference(ref_root / 'runs' / 'itest' / 't0', run_dir)}")
    if "lora" in layout:
        from safetensors.torch import load_file

        adapter = [load_file(str(d / "checkpoints" / "final" / "lora_adapter" / "adapter_model.safetensors"))
                   for d in (ref_root / "runs" / "itest" / "t0", run_dir)]
        assert adapter[0].keys() == adapter[1].keys() and adapter[0]
        assert all(torch_equal(adapter[0][k], adapter[1][k]) for k in adapter[0]), "final adapter differs"
    # and training actually changed them (the comparison is not vacuous)
    from safetensors.torch import load_file

    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert any(not (base[k] == a[k]).all() for k in base if k in a)
