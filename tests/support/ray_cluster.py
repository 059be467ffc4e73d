"""A real multi-node Ray cluster on this machine: one `ray start --block` per node, each in its own session.

Every node is a separate raylet with its own logical CPUs, name and custom resources; a node can be
started through a command prefix (e.g. ``unshare -m sh -c "mount -t tmpfs ... && exec \"$@\"" sh``) so
that its processes see a private filesystem view. ``stop()`` ends exactly the processes the nodes
started (every process in their sessions), never anything else named ``ray``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli.utils.network import find_free_port

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENV)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    return env


@dataclass
class LocalRayCluster:
    log_dir: Path
    port: int = field(default_factory=find_free_port)
    dashboard_port: int = field(default_factory=find_free_port)
    procs: list[subprocess.Popen] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(
        self,
        name: str,
        num_cpus: int,
        resources: dict[str, float] | None = None,
        prefix: list[str] | None = None,
        head: bool | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start one node; ``wait``: until it has registered (one raylet starting at a time keeps Ray's
        30 s registration limit on a loaded 2-core machine). ``env``: this node's own variables (its
        workers inherit them), e.g. a per-node HF_HOME."""
        head = not self.procs if head is None else head
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [
            ray,
            "start",
            "--block",
            f"--num-cpus={num_cpus}",
            f"--node-name={name}",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--resources={json.dumps(resources or {})}",
        ]
        if head:
            argv += [
                "--head",
                f"--port={self.port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                "--node-ip-address=127.0.0.1",
            ]
        else:
            argv += [f"--address={self.address}", "--node-ip-address=127.0.0.1"]
        log = open(self.log_dir / f"ray_{name}.log", "ab")
        self.procs.append(
            subprocess.Popen(
                [*(prefix or []), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**ray_env(), **(env or {})},
                start_new_session=True,
            )
        )
        self.names.append(name)
        log.close()
        if wait:
            self.wait_nodes()

    def query(self, code: str, timeout: float = 120) -> object:
        """Run ``code`` in a fresh driver connected to the cluster; it must print one JSON value last."""
        prog = (
            "import json, ray\nray.init(address=%r, log_to_driver=False, logging_level='error')\n%s\n"
            "ray.shutdown()\n" % (self.address, code)
        )
        r = subprocess.run(
            [sys.executable, "-c", prog], capture_output=True, text=True, env=ray_env(), timeout=timeout
        )
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        return json.loads(r.stdout.strip().splitlines()[-1])

    def nodes(self) -> list[dict]:
        return self.query(
            "print(json.dumps([{'id': n['NodeID'], 'name': n['NodeName'], "
            "'resources': n['Resources']} for n in ray.nodes() if n['Alive']]))"
        )

    def wait_nodes(self, timeout: float = 180) -> list[dict]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p, name in zip(self.procs, self.names):
                if p.poll() is not None:
                    raise RuntimeError(
                        f"ray node {name} exited: {(self.log_dir / f'ray_{name}.log').read_text()[-3000:]}"
                    )
            try:
                nodes = self.nodes()
                if sorted(n["name"] for n in nodes) == sorted(self.names):
                    return nodes
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError):
                pass
            time.sleep(1)
        raise RuntimeError(f"the Ray cluster did not reach {len(self.names)} nodes within {timeout}s")

    def ray_list(self, kind: str) -> list[dict]:
        """`ray list <kind>` (the CLI, through the dashboard's state API), dead entries included."""
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [ray, "list", kind, "--address", self.dashboard, "--format", "json", "--detail", "--limit", "10000"]
        r = subprocess.run(argv, capture_output=True, text=True, env=ray_env(), timeout=120)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        out = r.stdout.strip()
        return [] if out.startswith("No resource") else json.loads(out or "[]")  # Ray's words for none

    def list_actors(self) -> list[dict]:
        return self.ray_list("actors")

    def stop(self) -> None:
        import psutil

        sessions = {p.pid for p in self.procs}
        for p in reversed(self.procs):  # workers first; `ray start --block` stops its children on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 20
        while time.time() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getsid(proc.info["pid"]) in sessions:
                    os.kill(proc.info["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
