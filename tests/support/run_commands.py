"""`areal runs` / `status` / `logs` through the real CLI in a subprocess, and the checks every launcher's
finished run must pass (tests/integration/cli/test_run_commands.py for local runs, test_slurm.py for
SLURM)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def cli_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("AREAL_DEBUG", None)
    return env


def areal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", *args], check=False,
                          capture_output=True, text=True, env=cli_env(), timeout=timeout)


def status_json(*args: str) -> dict:
    p = areal("status", "--json", *args)
    assert p.returncode == 0, (p.stdout, p.stderr)
    return json.loads(p.stdout)


def runs_json(fileroot: Path) -> dict[str, dict]:
    p = areal("runs", "--json", "--fileroot", str(fileroot))
    assert p.returncode == 0, (p.stdout, p.stderr)
    return {r["run"]: r for r in json.loads(p.stdout)}


def documented_status_keys() -> set[str]:
    """The `status --json` keys docs/train.md documents (its "status --json" table's first column)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "train.md").read_text()
    section = text.split("#### `areal status --json`", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))


def check_finished_run(run_dir: Path, fileroot: Path, total_steps: int, launcher: str) -> dict:
    """A run that ended well, seen through all three commands; returns its `status --json` object."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    name = f"{run_dir.parent.name}/{run_dir.name}"

    s = status_json(str(run_dir))
    assert set(s) == documented_status_keys(), set(s) ^ documented_status_keys()
    assert (s["run"], s["state"], s["phase"], s["launcher"]) == (name, "finished", "finished", launcher), s
    assert (s["step"], s["total_steps"]) == (train[-1]["step"], total_steps) == (total_steps, total_steps)
    assert s["last_eval"]["step"] == evals[-1]["step"]
    assert s["last_eval"]["accuracy"] == evals[-1]["eval/pass@1"]
    assert s["samples_per_s"] == train[-1]["perf/samples_per_s"]
    assert s["staleness_mean"] == train[-1]["staleness/mean"]
    assert s["error"] is None and s["eta_s"] == 0.0
    assert [p["state"] for p in s["trainer_ranks"]] == ["done"]
    assert [(p["name"], p["state"]) for p in s["servers"]] == [("server0", "stopped")]
    # The same run named as EXPERIMENT/TRIAL and as EXPERIMENT under its fileroot.
    assert status_json(name, "--fileroot", str(fileroot))["run_dir"] == s["run_dir"]
    assert status_json(run_dir.parent.name, "--fileroot", str(fileroot))["run_dir"] == s["run_dir"]

    row = runs_json(fileroot)[name]
    assert (row["state"], row["step"], row["last_eval"]) == ("finished", total_steps, s["last_eval"])
    table = areal("runs", "--fileroot", str(fileroot))
    assert table.returncode == 0 and name in table.stdout and "finished" in table.stdout, table.stdout

    watched = areal("status", str(run_dir), "--watch", "--interval", "0.1")  # the run is over: one frame
    assert watched.returncode == 0 and "finished" in watched.stdout, watched.stderr
    both = areal("status", str(run_dir), "--watch", "--json")
    assert both.returncode == 2 and both.stderr.startswith("error: --watch and --json do not combine — fix:")
    text = areal("status", str(run_dir))
    assert text.returncode == 0 and "finished" in text.stdout
    assert f"{total_steps}/{total_steps}" in text.stdout

    log = areal("logs", str(run_dir))
    assert log.returncode == 0 and log.stdout == (run_dir / "logs" / "trainer_rank0.log").read_text()
    tail = areal("logs", str(run_dir), "--server", "0", "-n", "2")
    server_lines = (run_dir / "logs" / "server0.log").read_text().splitlines()
    assert tail.returncode == 0 and tail.stdout.splitlines() == server_lines[-2:]
    missing = areal("logs", str(run_dir), "--rank", "7")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == (f"error: the run has no trainer rank 7 (trainer ranks of {name}: 0) — fix: "
                              "pass --rank 0\n"), missing.stderr
    return s
