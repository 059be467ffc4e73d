"""``launcher=skypilot``: the plan as one SkyPilot task (``sky.Task`` YAML), one node runner per node.

- resources: accelerators from ``launcher.skypilot.accelerators`` or derived from the plan
  (``cluster.n_gpus_per_node`` GPUs of the ``cluster.hardware`` kind, or of a type that fits the GPU
  memory), cloud, region, spot;
- ``num_nodes`` = the plan's node count; ``setup`` installs areal-cli; ``envs`` carry the
  launcher env and the run's identity (and ``HF_ENDPOINT`` when set here; ``HF_TOKEN`` goes to
  ``sky launch --env HF_TOKEN`` by name, so no file holds it);
- each node's runner fetches a hub ``model.path`` into the node's HF cache first (``HF_HOME`` from
  ``launcher.trainer_env`` puts that cache on shared storage);
- ``run`` derives the rendezvous from SkyPilot's ``SKYPILOT_NODE_IPS`` (first line = master) and
  ``SKYPILOT_NODE_RANK`` and starts :func:`areal_cli.launchers.local.run_node` through
  ``python -m areal_cli.launchers.skypilot node``;
- ``file_mounts``: the shared fileroot (a SkyPilot bucket mount unless
  ``launcher.skypilot.file_mounts`` names one) plus the run's ``config.yaml`` / ``launch.json``.

SkyPilot pins click/uvicorn versions that conflict with this project's CLI stack, so it may live
in its own virtualenv: the YAML is validated with ``sky.Task.from_yaml`` in-process when ``sky``
imports, else with the interpreter at ``AREAL_SKYPILOT_PYTHON`` (default
``~/.cache/areal/skypilot-venv/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import LaunchError
from areal_cli.job.layout import JobLayout

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

LAUNCH_DIR = "~/.areal_launch"  # where config.yaml / launch.json land on every node
DEFAULT_MASTER_PORT = 29500
SKY_VENV_PYTHON = "~/.cache/areal/skypilot-venv/bin/python"

# Credentials SkyPilot looks for, per cloud: (env vars, files). Any one present = configured.
CLOUD_CREDENTIALS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "aws": (("AWS_ACCESS_KEY_ID",), ("~/.aws/credentials", "~/.aws/config")),
    "gcp": (("GOOGLE_APPLICATION_CREDENTIALS",), ("~/.config/gcloud/application_default_credentials.json",
                                                  "~/.config/gcloud/credentials.db")),
    "azure": ((), ("~/.azure/msal_token_cache.json", "~/.azure/azureProfile.json")),
    "kubernetes": (("KUBECONFIG",), ("~/.kube/config",)),
    "lambda": ((), ("~/.lambda_cloud/lambda_keys",)),
    "runpod": ((), ("~/.runpod/config.toml",)),
    "oci": ((), ("~/.oci/config",)),
    "paperspace": ((), ("~/.paperspace/config.json",)),
    "nebius": ((), ("~/.nebius/credentials.json",)),
}


def accelerators_for(cfg: ExperimentConfig, layout: JobLayout) -> str | None:
    """``launcher.skypilot.accelerators`` or a GPU type/count derived from the plan; None on CPU."""
    sp = cfg.launcher.skypilot
    if sp.accelerators:
        return str(sp.accelerators)
    if layout.device != "cuda":
        return None
    from areal_cli.allocation.hardware import gpu_memory_gb

    n = int(cfg.cluster.n_gpus_per_node)
    named = _SKY_GPU.get(str(cfg.cluster.hardware).strip().lower())
    if named:  # cluster.hardware names the GPU kind
        return f"{named}:{n}"
    mem = gpu_memory_gb(cfg)
    # The smallest common GPU whose memory covers the cluster's GPU memory.
    gpu = next(name for need, name in ((80, "H100"), (48, "L40S"), (40, "A100"), (24, "A10G"), (0, "T4"))
               if mem >= need)
    return f"{gpu}:{n}"


# cluster.hardware's built-in GPU kinds as SkyPilot names them (`sky show-gpus`).
_SKY_GPU = {"h100": "H100", "h200": "H200", "a100": "A100-80GB", "b200": "B200", "l40s": "L40S"}


def _remote_run_dir(cfg: ExperimentConfig) -> str:
    return "/".join([str(cfg.cluster.fileroot).rstrip("/"), "runs", cfg.experiment_name, cfg.trial_name])


def run_script(cfg: ExperimentConfig) -> str:
    """The per-node command: rendezvous from SkyPilot's env, then this node's share of the plan."""
    run_dir = _remote_run_dir(cfg)
    return "\n".join([
        "set -euo pipefail",
        'export MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
        'export NODE_IP=$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")',
        f"export MASTER_PORT=${{AREAL_MASTER_PORT:-{DEFAULT_MASTER_PORT}}}",
        "python -m areal_cli.launchers.skypilot node"
        f" --launch-dir {LAUNCH_DIR} --run-dir {shlex.quote(run_dir)}"
        ' --node-rank "$SKYPILOT_NODE_RANK" --num-nodes "$SKYPILOT_NUM_NODES"'
        ' --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --node-ip "$NODE_IP"',
    ])


def build_task_config(cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any]:
    """The SkyPilot task as a YAML-ready dict (the schema ``sky.Task.from_yaml`` reads)."""
    sp = cfg.launcher.skypilot
    resources: dict[str, Any] = {}
    acc = accelerators_for(cfg, layout)
    if acc:
        resources["accelerators"] = acc
    else:
        resources["cpus"] = f"{max(2, int(cfg.cluster.n_gpus_per_node))}+"
    if sp.cloud:
        resources["cloud"] = sp.cloud
    if sp.region:
        resources["region"] = sp.region
    if sp.use_spot:
        resources["use_spot"] = True
    envs = {"HF_HUB_OFFLINE": "0", "TOKENIZERS_PARALLELISM": "false", "AREAL_RUN_NAME":
            f"{cfg.experiment_name}/{cfg.trial_name}", "AREAL_MASTER_PORT": str(DEFAULT_MASTER_PORT)}
    if os.environ.get("HF_ENDPOINT"):  # a hub mirror the nodes fetch the model from, as this machine does
        envs["HF_ENDPOINT"] = os.environ["HF_ENDPOINT"]
    envs.update({str(k): str(v) for k, v in dict(cfg.launcher.trainer_env).items()})
    mounts: dict[str, Any] = {f"{LAUNCH_DIR}/config.yaml": os.path.join(run_dir, "config.yaml"),
                              f"{LAUNCH_DIR}/launch.json": os.path.join(run_dir, "launch.json")}
    user_mounts = {str(k): v for k, v in dict(sp.file_mounts).items()}
    if not any(str(k).rstrip("/") == str(cfg.cluster.fileroot).rstrip("/") for k in user_mounts):
        # Every node must see one fileroot: a SkyPilot-managed bucket, mounted with a local cache so
        # checkpoints get POSIX writes and atomic renames (plain MOUNT lacks them).
        bucket = f"areal-{cfg.experiment_name}-fileroot".lower().replace("_", "-")
        mounts[str(cfg.cluster.fileroot)] = {"name": bucket, "mode": "MOUNT_CACHED"}
    mounts.update(user_mounts)
    task: dict[str, Any] = {
        "name": f"areal-{cfg.experiment_name}-{cfg.trial_name}".lower().replace("_", "-"),
        "num_nodes": int(layout.n_nodes),
        "resources": resources,
        "workdir": sp.workdir,
        "setup": sp.setup,
        "envs": envs,
        "file_mounts": mounts,
        "run": run_script(cfg),
    }
    return task


def task_yaml(task: dict[str, Any]) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, data: str):
        style = "|" if "\n" in data else None  # the run/setup scripts stay readable
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(task, Dumper=_Dumper, sort_keys=False)


def sky_python() -> str | None:
    """An interpreter that can ``import sky``: this one, or the SkyPilot venv."""
    try:
        import sky  # noqa: F401

        return sys.executable
    except ImportError:
        pass
    cand = os.path.expanduser(os.environ.get("AREAL_SKYPILOT_PYTHON", SKY_VENV_PYTHON))
    return cand if os.path.isfile(cand) and os.access(cand, os.X_OK) else None


_VALIDATE = """
import json, sys
import sky
t = sky.Task.from_yaml(sys.argv[1])
res = sorted(t.resources, key=str)
print(json.dumps({"name": t.name, "num_nodes": t.num_nodes, "run": t.run, "setup": t.setup,
                  "envs": dict(t.envs), "file_mounts": {k: str(v) for k, v in (t.file_mounts or {}).items()},
                  "storage_mounts": sorted((t.storage_mounts or {}).keys()),
                  "accelerators": [r.accelerators for r in res], "cpus": [r.cpus for r in res],
                  "use_spot": [r.use_spot for r in res], "workdir": t.workdir}))
"""


def validate_yaml(path: str) -> dict[str, Any]:
    """Parse the task with SkyPilot's own ``sky.Task.from_yaml``; returns what SkyPilot understood."""
    py = sky_python()
    if py is None:
        raise LaunchError("cannot validate the SkyPilot task: skypilot is not installed — fix: "
                          "`python -m venv ~/.cache/areal/skypilot-venv && ~/.cache/areal/skypilot-venv/bin/pip "
                          "install skypilot` (or pip install 'areal-cli[skypilot]' in a separate env) and "
                          "set AREAL_SKYPILOT_PYTHON to its python")
    r = subprocess.run([py, "-c", _VALIDATE, path], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.abspath(path)))
    if r.returncode != 0:
        raise LaunchError(f"SkyPilot rejected the task YAML {path}: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def missing_credentials(cloud: str | None) -> list[str]:
    """Human-readable list of what is missing; empty when some (or the chosen) cloud is configured."""
    clouds = [cloud.lower()] if cloud else list(CLOUD_CREDENTIALS)
    found = []
    for c in clouds:
        envs, files = CLOUD_CREDENTIALS.get(c, ((), ()))
        if any(os.environ.get(e) for e in envs) or any(os.path.exists(os.path.expanduser(f)) for f in files):
            found.append(c)
    if found:
        return []
    out = []
    for c in clouds:
        envs, files = CLOUD_CREDENTIALS.get(c, ((), ()))
        what = [f"${e}" for e in envs] + list(files)
        out.append(f"{c}: none of {', '.join(what) or '(unknown cloud)'}")
    return out


def write_task(cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> str:
    path = os.path.join(run_dir, "skypilot_task.yaml")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    Path(path).write_text(task_yaml(build_task_config(cfg, layout, run_dir)))
    return path


def dry_run(cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any]:
    """The task YAML for ``areal train launcher=skypilot --dry-run``.

    Checked with SkyPilot's own parser when SkyPilot is installed; without it the YAML is still
    printed, marked as not checked, since a dry run must work where nothing is installed.
    """
    import tempfile

    text = task_yaml(build_task_config(cfg, layout, run_dir))
    if sky_python() is None:
        return {"task_yaml": text, "checked_by_skypilot": False,
                "note": "not checked by SkyPilot: skypilot is not installed here — fix: "
                        "`python -m venv ~/.cache/areal/skypilot-venv && ~/.cache/areal/skypilot-venv/bin/pip "
                        "install skypilot`, or set AREAL_SKYPILOT_PYTHON"}
    with tempfile.TemporaryDirectory() as d:
        # SkyPilot checks that local file-mount sources exist: validate a copy whose run-dir sources
        # are stand-ins; the printed YAML keeps the real run dir.
        for name in ("config.yaml", "launch.json"):
            Path(d, name).write_text("{}")
        Path(d, "task.yaml").write_text(task_yaml(build_task_config(cfg, layout, d)))
        validate_yaml(str(Path(d, "task.yaml")))
    return {"task_yaml": text, "checked_by_skypilot": True, "note": None}


class SkyPilotLauncher:
    name = "skypilot"
    fetches_model_on_nodes = True  # node_main → run_node fetches a hub model into each node's HF cache

    def preflight(self, cfg: ExperimentConfig, layout: JobLayout) -> None:
        if sky_python() is None:
            raise LaunchError("launcher=skypilot needs SkyPilot, which is not installed — fix: "
                              "`python -m venv ~/.cache/areal/skypilot-venv && ~/.cache/areal/skypilot-venv/bin/pip "
                              "install skypilot` (or set AREAL_SKYPILOT_PYTHON); `areal train launcher=skypilot "
                              "--dry-run` prints the task YAML without it")

    def dry_run(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str) -> dict[str, Any]:
        return dry_run(cfg, layout, run_dir)

    def launch(self, cfg: ExperimentConfig, layout: JobLayout, run_dir: str, *, model_path: str | None = None,
               model_revision: str | None = None, on_tick: Callable[[], None] | None = None) -> int:
        # the cloud's nodes fetch the model and report nothing to tick on: the three are unused
        path = write_task(cfg, layout, run_dir)
        missing = missing_credentials(cfg.launcher.skypilot.cloud)
        if missing:
            raise LaunchError("launcher=skypilot found no cloud credentials (" + "; ".join(missing) + ") — fix: "
                              "configure a cloud and check it with `sky check`; the task is in " + path)
        validate_yaml(path)
        py = sky_python()
        sky_bin = shutil.which("sky") or (os.path.join(os.path.dirname(py), "sky") if py else None)
        if not sky_bin or not os.path.exists(sky_bin):
            raise LaunchError("the `sky` CLI was not found next to the SkyPilot interpreter — fix: "
                              "install skypilot there")
        cluster = cfg.launcher.skypilot.cluster_name or f"areal-{cfg.experiment_name}".lower().replace("_", "-")
        argv = [sky_bin, "launch", "-y", "-c", cluster, path]
        if os.environ.get("HF_TOKEN"):  # the nodes' hub access; by name, so the value stays out of the YAML
            argv += ["--env", "HF_TOKEN"]
        print(f"[areal] {' '.join(argv)}", file=sys.stderr, flush=True)
        return subprocess.call(argv)


# ---------------------------------------------------------------- node side

def node_main(argv: list[str] | None = None) -> int:
    """Runs on every SkyPilot node (the task's ``run``)."""
    ap = argparse.ArgumentParser(prog="python -m areal_cli.launchers.skypilot node")
    ap.add_argument("--launch-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--num-nodes", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--node-ip", default="")
    a = ap.parse_args(argv)
    from areal_cli.launchers.local import run_node
    from areal_cli.config.io import load_config_file

    launch_dir = Path(os.path.expanduser(a.launch_dir))
    run_dir = Path(os.path.expanduser(a.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    if a.node_rank == 0:
        for name in ("config.yaml", "launch.json"):
            tmp = run_dir / f".{name}.tmp"
            shutil.copyfile(launch_dir / name, tmp)
            os.replace(tmp, run_dir / name)
    deadline = time.time() + 600
    while not (run_dir / "launch.json").exists():  # node 0 copies it onto the shared fileroot
        if time.time() > deadline:
            raise LaunchError(f"{run_dir}/launch.json never appeared; the fileroot seems not shared between "
                              "nodes — fix: mount one shared fileroot on every node (areal check-storage)")
        time.sleep(0.5)
    cfg = load_config_file(str(run_dir / "config.yaml"))
    info = json.loads((run_dir / "launch.json").read_text())
    layout = JobLayout.from_dict(info["layout"])
    return run_node(cfg, layout, str(run_dir), a.node_rank, master_addr=a.master_addr, master_port=a.master_port,
                    model_path=info.get("model_path"), server_host=a.node_ip or "127.0.0.1",
                    model_revision=info.get("model_revision"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        sys.exit(node_main(sys.argv[2:]))
    sys.exit("usage: python -m areal_cli.launchers.skypilot node ...")
