"""SkyPilot task building; the YAML is parsed by SkyPilot itself (sky.Task.from_yaml)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.errors import LaunchError
from areal_cli.job.layout import JobLayout
from areal_cli.launchers.skypilot import (
    SkyPilotLauncher,
    build_task_config,
    missing_credentials,
    run_script,
    sky_python,
    task_yaml,
    validate_yaml,
)
from areal_cli.trainer.build import layout_from_plan

needs_sky = pytest.mark.skipif(sky_python() is None, reason="skypilot not installed (see docs/cluster.md)")

GPU = ["launcher=skypilot", "cluster=gpu_2x8", "allocation_mode=sglang:d8+fsdp:d8", "model=qwen2_5_1_5b",
       "experiment_name=exp", "trial_name=t1"]


def _task(overrides, tmp_path):
    cfg = load_config(overrides + [f"cluster.fileroot={tmp_path}/root"])
    layout = layout_from_plan(cfg, None)
    return cfg, layout, build_task_config(cfg, layout, str(tmp_path / "run"))


def test_gpu_plan_maps_to_resources_nodes_and_mounts(tmp_path):
    cfg, layout, t = _task(GPU, tmp_path)
    assert layout.n_nodes == 2
    assert t["num_nodes"] == 2
    assert t["resources"]["accelerators"] == "H100:8"  # 8 GPUs/node, 80 GB class
    assert t["file_mounts"][f"{tmp_path}/root"]["mode"] == "MOUNT_CACHED"
    assert t["file_mounts"]["~/.areal_launch/launch.json"] == str(tmp_path / "run" / "launch.json")
    assert "SKYPILOT_NODE_IPS" in t["run"] and "SKYPILOT_NODE_RANK" in t["run"]
    assert t["setup"] == cfg.launcher.skypilot.setup


def test_cpu_plan_asks_for_cpus_and_user_mount_replaces_bucket(tmp_path):
    _, _, t = _task(["launcher=skypilot", f"+launcher.skypilot.file_mounts={{{tmp_path}/root: /nfs/areal}}"],
                    tmp_path)
    assert "accelerators" not in t["resources"] and t["resources"]["cpus"].endswith("+")
    assert t["file_mounts"][f"{tmp_path}/root"] == "/nfs/areal"


def test_explicit_accelerators_cloud_spot(tmp_path):
    _, _, t = _task(GPU + ["launcher.skypilot.accelerators=A100-80GB:8", "launcher.skypilot.cloud=aws",
                           "launcher.skypilot.use_spot=true", "launcher.skypilot.region=us-east-1"], tmp_path)
    assert t["resources"] == {"accelerators": "A100-80GB:8", "cloud": "aws", "region": "us-east-1",
                              "use_spot": True}


@needs_sky
def test_yaml_is_parsed_by_skypilot(tmp_path):
    cfg, layout, t = _task(GPU + ["launcher.skypilot.use_spot=true"], tmp_path)
    (tmp_path / "run").mkdir()
    for name in ("config.yaml", "launch.json"):
        (tmp_path / "run" / name).write_text("{}")
    path = tmp_path / "task.yaml"
    path.write_text(task_yaml(t))
    parsed = validate_yaml(str(path))
    assert parsed["num_nodes"] == 2
    assert parsed["accelerators"] == [{"H100": 8}]
    assert parsed["use_spot"] == [True]
    assert parsed["envs"]["AREAL_MASTER_PORT"] == "29500"
    assert f"{tmp_path}/root" in parsed["storage_mounts"]
    assert "~/.areal_launch/config.yaml" in parsed["file_mounts"]
    assert parsed["run"] == t["run"]


@pytest.mark.slow  # one more SkyPilot import (~10 s); the positive parse runs in the default suite
@needs_sky
def test_skypilot_rejects_a_broken_task(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("num_nodes: 2\nresources:\n  accelerators: H100:8\n  no_such_field: 1\nrun: echo hi\n")
    with pytest.raises(LaunchError, match="SkyPilot rejected"):
        validate_yaml(str(path))


@needs_sky
def test_dry_run_cli_prints_validated_yaml():
    import yaml

    r = subprocess.run(["areal", "train", "--dry-run", *GPU], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    t = yaml.safe_load(r.stdout)
    assert t["num_nodes"] == 2 and t["resources"]["accelerators"] == "H100:8"
    assert t["name"] == "areal-exp-t1"
    # The file mounts point at the real run dir of this config.
    assert t["file_mounts"]["~/.areal_launch/config.yaml"].endswith("/runs/exp/t1/config.yaml")


def test_dry_run_without_skypilot_prints_the_unchecked_yaml(tmp_path):
    import shutil
    import sys

    import yaml

    env = {**os.environ, "AREAL_SKYPILOT_PYTHON": str(tmp_path / "no-such-python"), "NO_COLOR": "1",
           "PATH": os.path.dirname(sys.executable), "HOME": str(tmp_path)}  # no `sky`, no SkyPilot venv
    assert shutil.which("sky", path=env["PATH"]) is None
    r = subprocess.run(["areal", "train", "--dry-run", *GPU, f"cluster.fileroot={tmp_path}/root"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    t = yaml.safe_load(r.stdout)
    assert t["num_nodes"] == 2 and t["resources"] == {"accelerators": "H100:8"}
    assert t["file_mounts"]["~/.areal_launch/config.yaml"] == f"{tmp_path}/root/runs/exp/t1/config.yaml"
    assert "note: not checked by SkyPilot: skypilot is not installed here" in r.stderr
    assert not (tmp_path / "root").exists(), "a dry run creates nothing"
    r = subprocess.run(["areal", "train", "launcher=skypilot", f"cluster.fileroot={tmp_path}/root"],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "needs SkyPilot, which is not installed" in lines[0], r.stderr


def test_rendezvous_from_skypilot_env(tmp_path):
    """Run the task's script with SkyPilot's env and a stand-in `python` that prints its argv."""
    cfg = load_config(["launcher=skypilot", "experiment_name=e", "trial_name=t", f"cluster.fileroot={tmp_path}"])
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", SKYPILOT_NODE_IPS="10.0.0.1\n10.0.0.2\n",
               SKYPILOT_NODE_RANK="1", SKYPILOT_NUM_NODES="2")
    out = subprocess.run(["bash", "-c", run_script(cfg)], env=env, capture_output=True, text=True, check=True).stdout
    assert "--master-addr 10.0.0.1" in out and "--node-ip 10.0.0.2" in out and "--node-rank 1" in out
    assert "--num-nodes 2" in out and "--master-port 29500" in out and f"{tmp_path}/runs/e/t" in out


def test_missing_credentials_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS", "KUBECONFIG"):
        monkeypatch.delenv(k, raising=False)
    missing = missing_credentials(None)
    assert any(m.startswith("aws:") and "~/.aws/credentials" in m for m in missing)
    assert any(m.startswith("kubernetes:") for m in missing)
    assert missing_credentials("gcp") == ["gcp: none of $GOOGLE_APPLICATION_CREDENTIALS, "
                                          "~/.config/gcloud/application_default_credentials.json, "
                                          "~/.config/gcloud/credentials.db"]
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    assert missing_credentials(None) == [] and missing_credentials("aws") == []
    assert missing_credentials("gcp") != []
    cfg = load_config(GPU + [f"cluster.fileroot={tmp_path}/root", "launcher.skypilot.cloud=gcp"])
    layout: JobLayout = layout_from_plan(cfg, None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("config.yaml", "launch.json"):
        (run_dir / name).write_text("{}")
    with pytest.raises(LaunchError, match="no cloud credentials .*gcp: none of"):
        SkyPilotLauncher().launch(cfg, layout, str(run_dir))
    assert (run_dir / "skypilot_task.yaml").is_file()


def test_hub_access_reaches_the_nodes_but_the_token_stays_out_of_the_yaml(tmp_path, monkeypatch):
    """The nodes fetch a hub model.path themselves: the hub mirror goes into the task's envs; HF_TOKEN is passed to
    `sky launch --env HF_TOKEN` by name, so neither the dict nor the YAML written to the run dir holds it."""
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080")
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_write_me")
    _, _, t = _task(GPU + ["+launcher.trainer_env.HF_HOME=/shared/hf"], tmp_path)
    assert t["envs"]["HF_ENDPOINT"] == "http://mirror.example:8080" and t["envs"]["HF_HOME"] == "/shared/hf"
    assert "HF_TOKEN" not in t["envs"] and "hf_do_not_write_me" not in task_yaml(t)
    assert SkyPilotLauncher.fetches_model_on_nodes


def test_cluster_hardware_names_the_accelerator(tmp_path):
    """A GPU kind in cluster.hardware is the accelerator asked for, not the smallest type that fits its memory
    (141 GB would otherwise read as an 80 GB class)."""
    _, _, t = _task(GPU + ["cluster.hardware=h200"], tmp_path)
    assert t["resources"]["accelerators"] == "H200:8"
    _, _, t = _task(GPU + ["cluster.hardware=a100"], tmp_path)
    assert t["resources"]["accelerators"] == "A100-80GB:8"
