"""launcher=ray and a hub model.path: one download per Ray node, into that node's own HF cache.

A two-node Ray cluster on this machine (tests/support/ray_cluster.py) whose raylets have different HF_HOMEs,
and a local hub (tests/support/hub_server.py). The driver's RayJob runs its per-node fetch tasks: each node
gets its own snapshot, the driver's HF_ENDPOINT and HF_TOKEN reach the tasks (the raylets have neither), and
a node's failure comes back as the same one-line ConfigError.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hub_server import LocalHub
from ray_cluster import LocalRayCluster, ray_env

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

DRIVER = """
import json, sys
from areal_cli.config.compose import load_config
from areal_cli.errors import ConfigError
from areal_cli.launchers.ray import RayJob, RayLauncher
from areal_cli.trainer.build import layout_from_plan

address, fileroot = sys.argv[1], sys.argv[2]
out = {}
for repo in ("org/private", "org/nope"):
    cfg = load_config(["launcher=ray", f"launcher.ray.address={address}", "cluster.n_nodes=2",
                       "cluster.n_gpus_per_node=1", f"cluster.fileroot={fileroot}", f"model.path={repo}"])
    layout = layout_from_plan(cfg, None)
    launcher = RayLauncher()
    launcher.preflight(cfg, layout)
    job = RayJob(cfg, layout, fileroot + "/run", launcher.assignment, model_path=repo)
    try:
        job._fetch_model()
        out[repo] = {launcher.assignment[k].label: job.node_models[n.node_id]
                     for k, n in launcher.assignment.items()}
    except ConfigError as e:
        out[repo] = "ConfigError: " + str(e)
    finally:
        import ray
        ray.shutdown()
print(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def _needs_ray():
    pytest.importorskip("ray")


def test_each_ray_node_fetches_into_its_own_cache(tmp_path, tiny_model_dir):
    hub = LocalHub()
    hub.add_repo("org/private", tiny_model_dir, access="private", token="hf_secret")
    hub.start()
    c = LocalRayCluster(tmp_path / "ray_logs")
    (tmp_path / "ray_logs").mkdir()
    try:
        for name in ("node-a", "node-b"):  # online, each with its own cache; no token, no endpoint
            c.add_node(
                name, 1, {f"areal_{name}": 1}, env={"HF_HOME": str(tmp_path / name), "HF_HUB_OFFLINE": "0"}
            )
        env = {
            **ray_env(),
            "HF_ENDPOINT": hub.endpoint,
            "HF_TOKEN": "hf_secret",
            "HF_HOME": str(tmp_path / "drv"),
        }
        p = subprocess.run(
            [sys.executable, "-c", DRIVER, c.address, str(tmp_path / "root")],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-4000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        c.stop()
        hub.stop()
    paths = out["org/private"]
    assert len(paths) == 2
    for path in paths.values():  # each node's snapshot lies in that node's HF_HOME
        assert any(path.startswith(str(tmp_path / n) + "/hub/") for n in ("node-a", "node-b")), paths
    assert len({p.split("/hub/")[0] for p in paths.values()}) == 2
    assert set(hub.file_gets("org/private").values()) == {2}  # once per node
    assert not (tmp_path / "drv" / "hub").exists()  # the driver downloads nothing
    assert out["org/nope"].startswith(
        f"ConfigError: model.path: there is no model repo org/nope on {hub.endpoint}"
    )
