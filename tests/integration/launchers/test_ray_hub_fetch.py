"""launcher=ray and a hub model.path: one download per Ray node, into that node's own HF cache.

A two-node Ray cluster on this machine (tests/support/ray_cluster.py) whose raylets have different HF_HOMEs,
and a local hub (tests/support/hub_server.py). The driver's RayJob runs its per-node fetch tasks: each node
gets its own snapshot (the driver fetches config.json alone, to validate), the driver's HF_ENDPOINT and HF_TOKEN reach the tasks (the raylets have neither), and
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
from areal_cli.cli.common import compose_and_validate
from areal_cli.errors import ConfigError
from areal_cli.launchers.ray import RayJob, RayLauncher
from areal_cli.trainer.build import layout_from_plan

address, fileroot = sys.argv[1], sys.argv[2]
out = {}
def overrides(repo):
    return ["launcher=ray", f"launcher.ray.address={address}", "cluster.n_nodes=2", "cluster.n_gpus_per_node=1",
            f"cluster.fileroot={fileroot}", f"model.path={repo}", "experiment=cpu_default"]
try:  # a repo that does not exist is refused on the submitter, by its config.json fetch
    compose_and_validate(overrides("org/nope"), fetch_model=True)
except ConfigError as e:
    out["submit org/nope"] = "ConfigError: " + str(e)
# as `areal train` does: the submitter fetches config.json alone, to check the plan against the real model
cfg, plan = compose_and_validate(overrides("org/private"), fetch_model=True)
out["name"] = cfg.model.name
layout = layout_from_plan(cfg, plan)
launcher = RayLauncher()
launcher.preflight(cfg, layout)
for repo in ("org/private", "org/nope"):  # org/nope: a node's own failure comes back as the same one line
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
            "HF_HUB_OFFLINE": "0",  # the submitter is online too: it fetches config.json
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
    gets = hub.file_gets("org/private")
    assert gets.pop("config.json") == 3 and set(gets.values()) == {2}, gets  # the driver's config.json, then once per node
    assert out["name"] == "private"  # facts from the real config.json, not the tiny preset's
    drv = list((tmp_path / "drv" / "hub").rglob("*"))  # the driver fetched config.json, never the weights
    assert any(p.name == "config.json" for p in drv) and not any(p.suffix == ".safetensors" for p in drv), drv
    for key in ("org/nope", "submit org/nope"):
        assert out[key].startswith(f"ConfigError: model.path: there is no model repo org/nope on {hub.endpoint}"), out
