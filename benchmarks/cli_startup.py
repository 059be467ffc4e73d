"""CLI startup cost: `areal --help` and `areal validate-config` vs a bare `python -c pass`.

Runs each command N times, interleaved so machine load affects all alike, and prints the median
wall time, the median CPU time (user+sys of the child) and the ratio to the `python -c pass`
baseline measured in the same run. Target: both commands ≤ 0.5 s wall.

    python benchmarks/cli_startup.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time


def run_once(cmd: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.decode()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


ENV = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    areal = shutil.which("areal") or f"{sys.executable} -m areal_cli.cli.main"
    areal_cmd = areal.split()
    cases = {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        "areal --help": [*areal_cmd, "--help"],
        "areal validate-config": [*areal_cmd, "validate-config"],
        "areal validate-config <megatron example>": [
            *areal_cmd, "validate-config", "algo=grpo", "engine=megatron",
            "allocation_mode=sglang.d4+megatron.d2t2p2", "cluster.n_nodes=2", "cluster.n_gpus_per_node=8"],
        "areal validate-config --json": [*areal_cmd, "validate-config", "--json"],
    }
    for cmd in cases.values():  # warm the page cache / .pyc files
        run_once(cmd)
    walls: dict[str, list[float]] = {k: [] for k in cases}
    cpus: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for name, cmd in cases.items():
            w, c = run_once(cmd)
            walls[name].append(w)
            cpus[name].append(c)
    base_w = statistics.median(walls["python -c pass (baseline)"])
    base_c = statistics.median(cpus["python -c pass (baseline)"])
    load = os.getloadavg()[0]
    print(f"cpu count {os.cpu_count()}, load average (1 min) {load:.2f}, repeat {args.repeat}")
    print(f"{'command':45s} {'wall med':>9s} {'x base':>7s} {'cpu med':>8s} {'x base':>7s}  ≤0.5s wall")
    for name in cases:
        w, c = statistics.median(walls[name]), statistics.median(cpus[name])
        ok = "" if name.startswith("python") else ("yes" if w <= 0.5 else "NO")
        print(f"{name:45s} {w:8.3f}s {w / base_w:6.2f}x {c:7.3f}s {c / base_c:6.2f}x  {ok}")
    print("(cpu = user+sys of the child; on a loaded machine wall ≫ cpu, the ratio still compares like "
          "with like)")


if __name__ == "__main__":
    main()
