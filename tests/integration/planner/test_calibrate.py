"""``areal plan --calibrate`` for real, in quick mode: the built-in hf server decoding a tiny model, gloo between
two processes, a running training rank's memory; then the saved profile is what ``cluster.hardware=auto`` finds.

Slow (~30-60 s on two cores, mostly the server's and the two ranks' start-up): ``pytest -m slow``."""

from __future__ import annotations

import json
import math
import os

import pytest

from areal_cli.cli.plan_calibrate import run_calibrate
from areal_cli.plan.compose import load_config
from areal_cli.allocation.hardware import PROFILES, get_profile, resolve_hardware

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    hw = tmp_path_factory.mktemp("hw")
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_HARDWARE_DIR", str(hw))
    mp.setenv("DS_ACCELERATOR", "cpu")  # what calibrate sets for itself, restored after the module
    mp.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path, also on a GPU host
    yield hw, mp
    mp.undo()


def test_quick_calibration_measures_this_host_and_plans_pick_it_up(calibrated, capsys):
    hw, _ = calibrated
    assert run_calibrate("cpu", None, quick=True, json_out=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["saved"] == str(hw / "cpu.json")
    p, raw = out["profile"], out["profile"]["calibrated"]
    assert p["kind"] == "cpu" and p["shared_compute"] and p["source"].startswith("measured")
    for f in ("matmul_tflops", "mem_gb", "mem_bw_gbs", "intra_node_gbs", "decode_iter_s", "request_s",
              "process_base_gb"):
        assert math.isfinite(p[f]) and p[f] > 0, f
    for f in ("prefill_mfu", "comm_eff"):
        assert 0.3 <= p[f] <= 1.0, f
    # the profile's fields are the raw measurements they come from
    assert p["matmul_tflops"] == raw["gemm_tflops"] >= raw["gemm_tflops_1thread"] > 0
    assert p["mem_bw_gbs"] == raw["copy_gbs"] and p["intra_node_gbs"] == raw["allreduce_gbs"]
    assert raw["allreduce_backend"] == "gloo" and raw["allreduce_latency_s"] > 0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3
    assert p["mem_gb"] == pytest.approx(ram)
    # a running training rank (the FSDP engine built and stepped) holds more than a process that only
    # imported the trainer; its base is its high-water mark less the tiny model's states
    assert 0.05 < raw["imports_base_gb"] < p["process_base_gb"] < min(4.0, ram) and 0.05 < raw["server_rss_gb"] < 4.0
    assert p["process_base_gb"] == pytest.approx(
        raw["rank_hwm_gb"] - raw["rank_model_params"] * 16 / 1024 ** 3, abs=1e-3)
    # the t2 engine (archon over gloo) against d1 at the same micro-batches: a larger one takes longer on
    # both, and the profile's TP terms are what the two give
    for steps in (raw["tp2_step_s"], raw["d1_step_s"]):
        assert steps["32x48"] > steps["1x48"] > 0
    assert p["tp_layer_s"] == pytest.approx(
        max(0.0, raw["tp2_step_s"]["1x48"] - raw["d1_step_s"]["1x48"]) / 6)
    assert 0.05 <= p["tp_token_eff"] <= 1.0
    # decode: longer generations take longer, and batching makes each token cheaper
    t = raw["decode_times_s"]
    assert t["b1_n32"] > t["b1_n4"] and t["b8_n32"] > t["b8_n4"]
    assert raw["decode_iter_b8_s"] / 8 < raw["decode_iter_b1_s"]
    assert p["decode_iter_s"] <= raw["decode_iter_b1_s"]
    # training: Hugging Face's forward+backward of one sequence, a longer one taking longer (what prefill's
    # rate comes from) ...
    steps = raw["train_step_s_by_tokens"]
    assert steps["512"] > steps["64"]
    # ... and the engines' RL update at two widths and several micro-batch sizes: more rows take longer at
    # each width, the wider model is slower at the same rows, and each profile point is its measurement's
    # FLOPs over its seconds, against one thread's share of the GEMM rate; the fixed costs are inside them
    by = {(q["hidden"], q["rows"]): q for q in raw["rl_steps"]}
    assert sorted(by) == [(128, 32), (128, 128), (128, 256), (256, 32), (256, 128)]
    for h, rows in ((128, (32, 128, 256)), (256, (32, 128))):
        secs = [by[h, r]["seconds"] for r in rows]
        assert secs == sorted(secs) and secs[0] > 0
    assert by[256, 128]["seconds"] > by[128, 128]["seconds"]
    per_thread = raw["gemm_tflops"] * 1e12 / raw["cpu_cores"]
    assert p["train_mfu_points"] == [
        [q["hidden"], q["mb_tokens"], pytest.approx(min(1.5, max(0.02, q["flops"] / q["seconds"] / per_thread)))]
        for q in raw["rl_steps"]]
    assert p["train_mfu"] == p["train_mfu_points"][0][2] and p["train_mb_s"] == p["optim_step_s"] == 0.0
    assert set(raw["step_seconds"]) == {"GEMM rate", "memory bandwidth", "hf server decode",
                                        "train micro-batch and optimizer step",
                                        "all-reduce bandwidth, process memory and the engines' RL step"}
    # saved as "cpu": every CPU plan (cluster.hardware=auto) now uses it instead of the built-in guess
    got = get_profile("cpu")
    assert got.to_dict() == p and got != PROFILES["cpu"]
    assert resolve_hardware(load_config([])) == got
