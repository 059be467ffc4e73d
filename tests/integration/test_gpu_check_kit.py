"""The GPU check kit in the CPU suite (docs/gpu_check.md), so it cannot rot unnoticed where there is no GPU:
scripts/gpu_check.sh skips in one line without CUDA, and its gpu tests still collect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The modules of the check; each must keep tests under the `gpu` marker.
GPU_MODULES = ["tests/integration/inference/test_gpu_hf_server.py",
               "tests/integration/engines/test_gpu_engines.py",
               "tests/integration/cli/test_gpu_train.py",
               "tests/integration/inference/test_gpu_throughput.py"]


def test_gpu_check_skips_in_one_line_without_cuda():
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so this checks the skip on a GPU machine too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    env.pop("AREAL_GPU_CHECK_REHEARSE", None)
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env=env, timeout=120, cwd=REPO)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(lines) == 1 and "CUDA" in lines[0], lines


def test_gpu_tests_collect():
    """`pytest -m gpu` (what the script runs) lists every check, whatever the device."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-o", "addopts=",
                        "-p", "no:cacheprovider", *GPU_MODULES], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    for module in GPU_MODULES:
        assert any(i.startswith(module) for i in ids), f"no gpu test collected from {module}:\n{r.stdout}"
    for name in ("test_greedy_equals_hf_generate_bf16", "test_one_rank_forward_matches_hf[fsdp]",
                 "test_one_rank_forward_matches_hf[archon]", "test_one_rank_forward_matches_hf[megatron]",
                 "test_one_rank_forward_matches_hf[deepspeed]", "test_colocated_one_gpu_run[auto]",
                 "test_colocated_one_gpu_run[disk]", "test_inference_throughput_runs_and_is_recorded"):
        assert any(i.endswith(name) for i in ids), f"{name} not collected:\n{r.stdout}"
