"""``areal plan`` in-process through the real entry point: its output and its one-line errors."""

from __future__ import annotations

import json

import pytest

from areal_cli.cli.main import main


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HARDWARE_DIR", str(tmp_path / "hw"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


def test_human_output_names_the_terms_and_the_bottleneck(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    for word in ("memory per device", "one RL step", "generation", "training", "weight sync", "samples/s",
                 "bottleneck:", "hf:d1+fsdp:d1", "cpu"):
        assert word in out


def test_hardware_option_picks_the_profile(capsys):
    assert main(["plan", "--json", "--hardware", "a100", "cluster=gpu_1x8",
                 "allocation_mode=sglang:d4+fsdp:d4", "model=qwen2_5_1_5b"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hardware"]["name"] == "a100" and d["valid"] and d["step"]["step_s"] > 0


@pytest.mark.parametrize("args,needle", [
    (["--hardware", "tpu9"], "error: --hardware: unknown hardware profile 'tpu9'"),
    (["allocation_mode=sglang:d4+fsdp:d4", "cluster=gpu_1x8", "cluster.n_gpus_per_node=4"],
     "needs 8 devices but the cluster has 4"),
])
def test_bad_input_is_one_line_and_exit_1(capsys, args, needle):
    assert main(["plan", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[0] and "fix:" in err[0]
    assert not any("Traceback" in ln for ln in err)


def test_json_error_for_unknown_hardware(capsys):
    assert main(["plan", "--json", "--hardware", "tpu9"]) == 1
    out = capsys.readouterr().out
    d = json.loads(out)
    assert d["valid"] is False and "tpu9" in d["message"]


def test_calibrate_takes_no_overrides(capsys):
    assert main(["plan", "--calibrate", "rollout.group_size=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calibrate" in err[0] and "fix:" in err[0]


def test_calibrated_profile_is_used_by_name(capsys, tmp_path):
    from dataclasses import replace

    from areal_cli.allocation.hardware import PROFILES, save_profile

    save_profile(replace(PROFILES["cpu"], name="mybox", matmul_tflops=PROFILES["cpu"].matmul_tflops * 10))
    assert main(["plan", "--json", "cluster.hardware=mybox"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert main(["plan", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert fast["hardware"]["name"] == "mybox" and fast["step"]["train_s"] < slow["step"]["train_s"]
