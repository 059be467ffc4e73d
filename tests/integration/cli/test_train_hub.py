"""`areal train model.path=<hub id>` end to end against a local hub (tests/support/hub_server.py), with the
real huggingface_hub client:

- launcher=local (default suite): the CLI downloads the snapshot before validation and before any process
  starts; the hf server and the trainer ranks load the snapshot dir and the run trains;
- the node entry of the cluster launchers (e2e: ``python -m areal_cli.launchers.skypilot node``, what each
  SkyPilot node runs; slurm's node job calls the same ``run_node``): launch.json names the hub id and the
  pinned commit, the node fetches it into its own HF cache and its processes load that snapshot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import LocalHub

pytestmark = pytest.mark.timeout(600)

REPO = "org/hubtiny"
SHORT = [
    "trainer.total_steps=1",
    "trainer.sft_warmup_steps=0",
    "trainer.recover_every=0",
    "trainer.eval_every=0",
    "algo.batch_size=2",
    "rollout.group_size=2",
    "rollout.gconfig.max_new_tokens=4",
    "rollout.max_head_offpolicyness=0",
    "dataset.train_size=50",
    "dataset.test_size=4",
    "dataset.max_prompt_len=256",
    "rollout.weight_update=disk",
    "stats.live=false",
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model_dir):
    from areal_cli.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("hub_repo")
    repo = Path(
        make_tiny_model(
            root / "repo", tokenizer_dir=tiny_model_dir, seed=0, hidden_size=96, num_heads=6, num_kv_heads=3
        )
    )
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    h = LocalHub()
    h.commits = h.add_repo(REPO, repo)
    h.start()
    yield h
    h.stop()


def _env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        {
            "HOME": str(tmp_path / "home"),
            "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": endpoint,
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "OMP_NUM_THREADS": "1",
            "NO_COLOR": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("AREAL_DEBUG", None)
    return env


def _trained(run_dir: Path) -> list[dict]:
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in recs if r["kind"] == "train"]


def _loaded_from(run_dir: Path, snap: Path) -> None:
    """The hf server and trainer rank 0 loaded the snapshot dir, not the id."""
    assert f"serving {snap} on" in (run_dir / "logs" / "server0.log").read_text()
    assert f"model {snap}" in (run_dir / "logs" / "trainer_rank0.log").read_text()


def test_train_local_downloads_then_trains_from_the_snapshot(tmp_path, hub):
    hub.clear()
    run_dir = tmp_path / "runs" / "hub" / "t0"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_cli.cli.main",
            "train",
            f"model.path={REPO}",
            f"cluster.fileroot={tmp_path}",
            "experiment_name=hub",
            "trial_name=t0",
            *SHORT,
        ],
        check=False,
        capture_output=True,
        text=True,
        env=_env(tmp_path, hub.endpoint),
        timeout=540,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    snap = tmp_path / "hf" / "hub" / "models--org--hubtiny" / "snapshots" / hub.commits[0]
    assert json.loads((run_dir / "launch.json").read_text())["model_path"] == str(snap)
    assert [r["step"] for r in _trained(run_dir)] == [1]
    _loaded_from(run_dir, snap)
    gets = hub.file_gets(REPO)
    assert "pytorch_model.bin" not in gets and set(gets.values()) == {1} and "model.safetensors" in gets
    assert p.stderr.index(f"downloading {REPO}") < p.stderr.index("run dir")  # before anything started


@pytest.mark.e2e  # a second real run: CI's e2e phase
def test_node_entry_fetches_on_the_node_then_runs_its_processes(tmp_path, hub):
    """launch.json as `areal train launcher=skypilot` writes it (the hub id and the commit it pinned), then
    the node command SkyPilot runs on each node."""
    from areal_cli.plan.compose import load_config
    from areal_cli.trainer.build import layout_from_plan
    from areal_cli.config.io import save_config

    hub.clear()
    cfg = load_config(
        [
            f"model.path={REPO}",
            # composed before any fetch, as the submitting CLI does: an uncached hub id that no preset names is
            # refused there (its architecture is unknown), so name a preset for the plan's facts; the node's
            # processes read the fetched snapshot's own config.json
            "model=qwen2_5_0_5b",
            "experiment=cpu_default",
            f"cluster.fileroot={tmp_path}",
            "experiment_name=hub",
            "trial_name=node",
            *SHORT,
        ]
    )
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir()
    save_config(cfg, launch_dir / "config.yaml")
    (launch_dir / "launch.json").write_text(
        json.dumps(
            {
                "layout": layout_from_plan(cfg, None).to_dict(),
                "model_path": REPO,
                "model_revision": hub.commits[0],
                "config": str(launch_dir / "config.yaml"),
            }
        )
    )
    run_dir = tmp_path / "runs" / "hub" / "node"
    node_hf = tmp_path / "node_hf"  # the node's own HF cache: nothing cached there yet
    env = {**_env(tmp_path, hub.endpoint), "HF_HOME": str(node_hf)}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_cli.launchers.skypilot",
            "node",
            "--launch-dir",
            str(launch_dir),
            "--run-dir",
            str(run_dir),
            "--node-rank",
            "0",
            "--num-nodes",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    snap = node_hf / "hub" / "models--org--hubtiny" / "snapshots" / hub.commits[0]
    assert (snap / "config.json").is_file()
    assert [r["step"] for r in _trained(run_dir)] == [1]
    _loaded_from(run_dir, snap)
    assert set(hub.file_gets(REPO).values()) == {1}
    # The pinned commit needs no look-up of a branch: the hub saw no revision query.
    assert not [c for c in hub.api_calls() if "/revision/" in c]
    shutil.rmtree(run_dir, ignore_errors=True)


def _free_port() -> int:
    from areal_cli.utils.network import find_free_port

    return find_free_port()
