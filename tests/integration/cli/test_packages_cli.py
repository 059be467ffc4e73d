"""The package check through the real CLI, as a new user meets it: megatron-core, deepspeed or sglang absent from
the Python that runs ``areal`` (hidden by a ``sitecustomize``, tests/support/hide_packages.py, exactly as an
absent package looks to every import). ``areal validate-config`` and ``areal train`` exit 1 with one line on
stderr naming the config path and the extra, and ``areal train`` starts nothing (no run dir, no logs). A plan
for a GPU cluster made on this machine passes with a warning. How long the refusal took is recorded, not
asserted."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest
from hide_packages import sitecustomize_env

HIDDEN = ("megatron", "deepspeed", "sglang")
CASES = [
    (["engine=megatron"], "engine.name: engine=megatron needs megatron-core", "areal-cli[megatron]"),
    (["engine=deepspeed"], "engine.name: engine=deepspeed needs deepspeed", "areal-cli[deepspeed]"),
    (["allocation_mode=sglang:d1+fsdp:d1"], "allocation_mode.spec: the sglang inference backend needs sglang",
     "areal-cli[sglang]"),
]


def areal(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    env = sitecustomize_env(tmp_path / "hide", HIDDEN)
    env.update({"HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"})
    env.pop("AREAL_DEBUG", None)
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", *args], check=False, capture_output=True,
                       text=True, env=env, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return p, {"wall_s": time.perf_counter() - t0,
               "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


def test_the_hidden_packages_are_absent_in_the_cli_process(tmp_path):
    """The premise: under the sitecustomize these packages cannot be found or imported."""
    env = sitecustomize_env(tmp_path / "hide", HIDDEN)
    code = ("import importlib.util, sys\n"
            "assert all(importlib.util.find_spec(n) is None for n in sys.argv[1:])\n"
            "try:\n    import megatron.core\nexcept ModuleNotFoundError:\n    print('absent')\n")
    p = subprocess.run([sys.executable, "-c", code, *HIDDEN], check=False, capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "absent", p.stderr


@pytest.mark.parametrize("overrides, says, extra", CASES)
def test_validate_config_refuses_in_one_line(tmp_path, overrides, says, extra):
    p, took = areal(tmp_path, "validate-config", *overrides)
    print(f"refused in {took['wall_s']:.2f} s wall, {took['cpu_s']:.2f} s CPU")  # shown with -rP; not asserted
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert says in lines[0] and f"which is not installed in this Python ({sys.executable})" in lines[0]
    assert extra in lines[0] and "Traceback" not in p.stderr


@pytest.mark.parametrize("overrides, says, extra", CASES)
def test_train_refuses_before_anything_starts(tmp_path, overrides, says, extra):
    root = tmp_path / "fileroot"
    p, took = areal(tmp_path, "train", f"cluster.fileroot={root}", "stats.live=false", *overrides)
    print(f"refused in {took['wall_s']:.2f} s wall, {took['cpu_s']:.2f} s CPU")  # shown with -rP; not asserted
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and extra in lines[0], p.stderr
    assert not root.exists(), sorted(str(q) for q in root.rglob("*"))  # no run dir, no logs, no server


def test_a_gpu_cluster_plan_made_here_passes_with_a_warning(tmp_path):
    p, _ = areal(tmp_path, "validate-config", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2",
                 "cluster=gpu_2x8")
    assert p.returncode == 0, p.stderr
    out = " ".join((p.stdout + p.stderr).split())  # the plan table wraps long warnings
    assert "valid configuration" in out
    assert "engine=megatron needs megatron-core" in out and "sglang inference backend needs sglang" in out
    assert "nodes that run this plan need it" in out


def test_installed_packages_pass_through_the_cli(tmp_path):
    """Nothing hidden: the engines this machine has validate (megatron/deepspeed where installed)."""
    from areal_cli.plan.packages import findable

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    engines = ["fsdp"] + [e for e, m in (("megatron", "megatron.core"), ("deepspeed", "deepspeed")) if findable(m)]
    for engine in engines:
        p = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "validate-config", f"engine={engine}"],
                           check=False, capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0 and "not installed" not in p.stdout + p.stderr, (engine, p.stderr)
