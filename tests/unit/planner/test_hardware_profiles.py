"""Hardware profiles: built-in names, saved (calibrated) profiles, ``cluster.hardware`` through the real
composed config and validation, and the memory a GPU cluster gets from its profile."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError
from areal_cli.allocation.hardware import (
    PROFILES,
    HardwareProfile,
    get_profile,
    gpu_memory_gb,
    hardware_name,
    known_profiles,
    profile_dir,
    resolve_hardware,
    save_profile,
)


@pytest.fixture(autouse=True)
def hardware_dir(tmp_path, monkeypatch):
    """Every test starts with an empty profile directory of its own (no profile the user calibrated)."""
    d = tmp_path / "hw"
    monkeypatch.setenv("AREAL_HARDWARE_DIR", str(d))
    return d


def test_builtin_profiles_are_consistent():
    assert {"h100", "h200", "a100", "b200", "l40s", "cpu"} <= set(PROFILES)
    for name, p in PROFILES.items():
        assert p.name == name and p.kind in ("gpu", "cpu") and p.source
        for f in ("matmul_tflops", "mem_gb", "mem_bw_gbs", "intra_node_gbs", "inter_node_gbs"):
            assert getattr(p, f) > 0, (name, f)
        for f in ("train_mfu", "prefill_mfu", "decode_bw_eff", "comm_eff"):
            assert 0 < getattr(p, f) <= 1, (name, f)
    # H200 is H100's compute with more and faster memory (the datasheets)
    h100, h200 = PROFILES["h100"], PROFILES["h200"]
    assert h200.matmul_tflops == h100.matmul_tflops and h200.mem_gb > h100.mem_gb
    assert h200.mem_bw_gbs > h100.mem_bw_gbs


def test_get_profile_by_name_is_case_insensitive():
    assert get_profile("H200") is PROFILES["h200"]
    assert get_profile(" l40s ") is PROFILES["l40s"]


def test_unknown_name_is_one_line_naming_the_key_and_the_known_names():
    with pytest.raises(ConfigError) as ei:
        get_profile("l40", key="cluster.hardware")
    e = ei.value
    assert e.path == "cluster.hardware" and "'l40'" in e.reason
    assert "did you mean 'l40s'?" in e.hint
    assert all(n in e.hint for n in PROFILES) and "--calibrate" in e.hint
    assert "\n" not in str(e)


def test_saved_profile_round_trips_and_wins_over_the_builtin(hardware_dir):
    p = replace(PROFILES["cpu"], name="mybox", matmul_tflops=0.25, decode_iter_s=0.0012,
                calibrated={"gemm_tflops": 0.25, "decode_times_s": {"b1_n4": 0.01}})
    path = save_profile(p)
    assert path == hardware_dir / "mybox.json" and profile_dir() == hardware_dir
    assert get_profile("mybox") == p
    assert "mybox" in known_profiles()
    # a calibrated "cpu" replaces the built-in guess for every CPU plan
    save_profile(replace(p, name="cpu"))
    assert get_profile("cpu").matmul_tflops == 0.25 and PROFILES["cpu"].matmul_tflops != 0.25
    # and a path to a .json file works wherever a name does
    other = save_profile(replace(p, name="elsewhere"), hardware_dir.parent / "x" / "box.json")
    assert get_profile(str(other)) == replace(p, name="elsewhere")


def test_unreadable_or_missing_profile_files(hardware_dir, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        get_profile(str(tmp_path / "nope.json"), key="cluster.hardware")
    hardware_dir.mkdir(parents=True)
    (hardware_dir / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError) as ei:
        get_profile("broken", key="cluster.hardware")
    assert ei.value.path == "cluster.hardware" and "cannot be read" in ei.value.reason


def test_from_dict_ignores_keys_a_newer_version_added():
    d = PROFILES["a100"].to_dict() | {"some_future_field": 3}
    assert HardwareProfile.from_dict(json.loads(json.dumps(d))) == PROFILES["a100"]


def test_auto_follows_the_device():
    cpu = load_config([])
    assert cpu.cluster.hardware == "auto" and cpu.cluster.gpu_memory_gb is None
    assert hardware_name(cpu.cluster) == "cpu" and resolve_hardware(cpu).kind == "cpu"
    gpu = load_config(["cluster.device=cuda"])
    assert resolve_hardware(gpu) is PROFILES["h100"] and gpu_memory_gb(gpu) == 80.0


def test_gpu_presets_name_h100_and_another_kind_brings_its_memory():
    cfg = load_config(["cluster=gpu_2x8"])
    assert cfg.cluster.hardware == "h100" and gpu_memory_gb(cfg) == 80.0
    h200 = load_config(["cluster=gpu_2x8", "cluster.hardware=h200"])
    assert resolve_hardware(h200).mem_gb == 141.0 and gpu_memory_gb(h200) == 141.0
    # an explicit cluster.gpu_memory_gb wins over the profile's
    mine = load_config(["cluster=gpu_2x8", "cluster.hardware=h200", "cluster.gpu_memory_gb=120"])
    assert resolve_hardware(mine).mem_gb == 120.0 and resolve_hardware(mine).matmul_tflops == 989.0


def test_validation_uses_the_profile_memory():
    args = ["cluster=gpu_1x8", "allocation_mode=gpu8_sglang_fsdp", "model=qwen2_5_7b"]
    h100 = validate(load_config(args))
    h200 = validate(load_config(args + ["cluster.hardware=h200"]))
    assert h100.inferences[0].memory.device_gb == 80.0 and h200.inferences[0].memory.device_gb == 141.0
    assert h200.inferences[0].memory.kv_tokens > h100.inferences[0].memory.kv_tokens


@pytest.mark.parametrize("overrides, reason", [
    (["cluster.hardware=h900"], "unknown hardware profile 'h900'"),
    (["cluster.hardware=h100"], "profile h100 is a GPU profile but cluster.device=cpu"),
    (["cluster=gpu_2x8", "cluster.hardware=cpu"], "profile cpu is a CPU profile but cluster.device=cuda"),
])
def test_validate_rejects_bad_hardware(overrides, reason):
    with pytest.raises(ConfigError) as ei:
        validate(load_config(overrides))
    assert ei.value.path == "cluster.hardware" and ei.value.reason == reason


def test_a_saved_gpu_profile_is_found_by_name(hardware_dir):
    save_profile(replace(PROFILES["h100"], name="mylab", mem_gb=94.0))
    cfg = load_config(["cluster=gpu_2x8", "cluster.hardware=mylab"])
    validate(cfg)
    assert gpu_memory_gb(cfg) == 94.0


def test_calibrate_refuses_a_name_that_is_a_path_before_measuring():
    from areal_cli.cli.plan_calibrate import run_calibrate
    from areal_cli.errors import UsageError

    for bad in ("a/b", "box.json", "-x", ""):
        with pytest.raises(UsageError, match="--name"):
            run_calibrate(bad, None, quick=True, json_out=True)


def test_profile_table_marks_what_was_measured():
    from rich.console import Console

    from areal_cli.cli.plan_calibrate import render_profile

    p = replace(PROFILES["cpu"], name="box", decode_iter_s=0.0012, source="measured here",
                calibrated={"seconds": 31.0})
    con = Console(record=True, width=160, color_system=None)
    render_profile(p, con)
    text = con.export_text()
    assert "hardware profile box" in text and "measured here" in text and "took 31 s" in text
    row = next(line for line in text.splitlines() if "decode_iter_s" in line)
    assert "1.2" in row and "ms" in row and "measured" in row
    con = Console(record=True, width=160, color_system=None)
    render_profile(PROFILES["h100"], con)  # a datasheet profile: nothing measured
    assert "measured" not in con.export_text().replace("measured by", "")
