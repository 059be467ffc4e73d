"""The GPU check kit in the CPU suite (docs/gpu_check.md), so it cannot rot unnoticed where there is no GPU:
scripts/gpu_check.sh skips in one line without CUDA, its preflight names a package the bundle expects but
the machine lacks, and its gpu tests still collect."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The modules of the check; each must keep tests under the `gpu` marker.
GPU_MODULES = ["tests/integration/inference/test_gpu_hf_server.py",
               "tests/integration/engines/test_gpu_engines.py",
               "tests/integration/engines/test_gpu_sharded_vocab.py",
               "tests/integration/cli/test_gpu_train.py",
               "tests/integration/inference/test_gpu_throughput.py"]


MISSING = "areal-gpu-check-no-such-package"  # a package no machine has


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    for k in ("AREAL_GPU_CHECK_REHEARSE", "GPU_CHECK_EXPECT_ALSO"):
        if k not in env:
            full.pop(k, None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], check=False,
                          capture_output=True, text=True, env=full, timeout=300, cwd=REPO)


def test_gpu_check_skips_in_one_line_without_cuda():
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so this checks the skip on a GPU machine too. The skip
    # comes before the preflight: a missing expected package does not turn it into a failure.
    r = _script(CUDA_VISIBLE_DEVICES="", GPU_CHECK_EXPECT_ALSO=MISSING)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(lines) == 1 and "CUDA" in lines[0] and "skipped" in lines[0], lines


def test_preflight_names_a_missing_expected_package(tmp_path):
    """With a device (here the CPU rehearsal), a package that the bundle leaves to the machine and that is
    not installed stops the check before pytest, in one line that names it and the fix."""
    r = _script(AREAL_GPU_CHECK_REHEARSE="cpu", GPU_CHECK_EXPECT_ALSO=MISSING,
                GPU_CHECK_RESULTS=str(tmp_path))
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 3, r.stdout + r.stderr
    assert len(lines) == 1 and MISSING in lines[0], lines
    assert f"pip install {MISSING}" in lines[0], lines
    assert not any(tmp_path.iterdir()), "pytest must not start (no results folder)"


def test_preflight_passes_here_and_lists_the_expected_packages():
    expected = subprocess.run(["bash", str(REPO / "scripts" / "gpu_bundle.sh"), "--print-expected"],
                              capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert "numpy" in expected, expected
    r = _script("--preflight", AREAL_GPU_CHECK_REHEARSE="cpu")
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(lines) == 1 and lines[0].startswith("gpu_check: preflight ok"), lines
    for name in expected:
        assert re.search(rf"\b{re.escape(name)} \S", lines[0]), (name, lines)


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
                 "test_one_rank_forward_matches_hf[deepspeed]", "test_flash_attention_2_matches_sdpa[fsdp]",
                 "test_colocated_one_gpu_run[auto]",
                 "test_colocated_one_gpu_run[disk]", "test_inference_throughput_runs_and_is_recorded",
                 "test_megatron_te_spec_moe_load_forward_export", "test_bf16_masters_on_cuda[megatron_moe]",
                 "test_sharded_table_makes_no_host_sync"):
        assert any(i.endswith(name) for i in ids), f"{name} not collected:\n{r.stdout}"


def test_script_runs_every_gpu_test(tmp_path):
    """The script collects only the files that carry the gpu marker (the bundle has no hypothesis etc. for
    the others): that must be every gpu test that collecting all of tests/ finds."""
    every = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                            "-o", "addopts=", "-p", "no:cacheprovider", "tests"], check=False,
                           capture_output=True, text=True, timeout=600, cwd=REPO)
    assert every.returncode == 0, every.stdout[-3000:] + every.stderr[-3000:]
    r = _script("--collect-only", "-q", AREAL_GPU_CHECK_REHEARSE="cpu", GPU_CHECK_RESULTS=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want, got = ({line for line in out.splitlines() if "::" in line} for out in (every.stdout, r.stdout))
    assert want and got == want, f"only in tests/: {want - got}; only in the script's run: {got - want}"
