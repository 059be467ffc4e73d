"""The server throughput benchmark (benchmarks/inference_throughput.py), briefly, on CUDA in bf16: the rows
are recorded in the check's results folder (scripts/gpu_check.sh; docs/gpu_check.md). Nothing is asserted
about speed (house rule: timings are measured and written down, never asserted); only that every row ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_check import DEVICE, needs_cuda, record, results_dir

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.timeout(900)]

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "inference_throughput.py"


def test_inference_throughput_runs_and_is_recorded(tmp_path):
    out = results_dir(tmp_path) / "inference_throughput.json"
    cmd = [sys.executable, str(BENCH), "--device", DEVICE, "--dtype", "bfloat16", "--batches", "8", "32",
           "--new-tokens", "32", "--repeats", "1", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=800)
    record("inference_throughput_log", {"cmd": cmd, "returncode": res.returncode,
                                        "stdout": res.stdout[-4000:], "stderr": res.stderr[-4000:]}, tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["batch"], r["row"]) for r in rows} == {(b, n) for b in (8, 32)
                                                     for n in ("hf_generate_batched", "hf_server")}
    assert all(r["tok_per_s"] > 0 for r in rows)
