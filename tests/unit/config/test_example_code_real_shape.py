"""The code-bearing examples at the shape they are sized for: each README's command, run through the real
CLI as ``areal validate-config --json`` instead of ``areal train`` (same ``--config-dir`` and overrides).

It plans the GPU cluster offline, so the command must be valid here, with no toy-sized warning. The CLI
imports ``plugins`` before it validates, so the example's code must import too. The probe reports each
imported plugin's file, which shows the code came from the example's own folder. ``train --cfg job``
(the composed config) shows the workflow, reward, agent or command are the example's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from support_paths import REPO

EXAMPLES = REPO / "examples"
# Runs the real entry point, then reports where each plugin module came from (AREAL_PLUGINS is what the
# CLI exported to the run's processes).
PROBE = ("import json, os, sys\nfrom areal_cli.cli.main import main\ncode = main(sys.argv[1:])\n"
         "mods = [m for m in os.environ.get('AREAL_PLUGINS', '').split(',') if m]\n"
         "sys.stderr.write('\\nPLUGINS=' + json.dumps({m: getattr(sys.modules.get(m), '__file__', None) "
         "for m in mods}) + '\\n')\nsys.exit(code)\n")

# What each example's composed config must name: its own code, and the workflow that runs it.
EXPECTED = {
    "multi_turn_math": {"plugins": [], "workflow.name": "multi_turn"},
    "agents_sdk_tool": {"plugins": ["calc_agent"], "workflow.name": "agent",
                        "workflow.kwargs.agent": "calc_agent:solve"},
    "langchain_proxy": {"plugins": ["lc_agent"],
                        "workflow.name": "areal_cli.rollout.workflows.agent_proxy:ProxyAgentWorkflow",
                        "workflow.kwargs.command": "python -m lc_agent"},
    "custom_workflow": {"plugins": ["self_verify"], "workflow.name": "self_verify"},
    "custom_reward": {"plugins": ["my_reward"], "workflow.name": "rlvr", "workflow.reward": "concise_math"},
    "online_agent": {"plugins": [], "workflow.name": "online", "rollout.group_size": 1},
}


def readme_command(name: str) -> list[str]:
    """The arguments after ``areal train`` on the ``areal train`` line of the README's first bash block."""
    text = (EXAMPLES / name / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    assert block, f"{name}/README.md has no ```bash block"
    lines = [re.split(r"\s#", ln)[0].strip() for ln in block.group(1).splitlines()]  # drop shell comments
    train = [ln for ln in lines if ln.startswith("areal train")]
    assert len(train) == 1, f"{name}/README.md: the first bash block needs exactly one `areal train` line"
    return shlex.split(train[0])[2:]


def _areal(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    for k in ("AREAL_PLUGINS", "AREAL_CONFIG_DIR"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-c", PROBE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def _wait(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def test_every_code_example_is_covered():
    """Every example that is a config dir of its own (code, or an experiment kept beside it) is checked here."""
    own_dirs = sorted(d.name for d in EXAMPLES.iterdir()
                      if d.is_dir() and (any(d.glob("*.py")) or (d / "experiment").is_dir()))
    assert set(own_dirs) == set(EXPECTED), own_dirs


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_readme_command_is_valid_at_its_real_shape(name):
    args = readme_command(name)
    assert ["--config-dir", f"examples/{name}"] == args[:2] and f"experiment={name}" in args, args
    job = _areal("train", "--cfg", "job", *args)  # the composed config, in parallel with the validation
    rc, out, err = _wait(_areal("validate-config", "--json", *args))
    assert rc == 0, out[-3000:] + err[-3000:]
    plan = json.loads(out)
    assert plan["valid"] and plan["cluster"]["device"] == "cuda", plan["cluster"]
    assert plan["cluster"]["n_devices_per_node"] * plan["cluster"]["n_nodes"] == plan["n_devices_used"]
    assert not [w for w in plan["warnings"] if "toy-sized" in w], plan["warnings"]
    imported = json.loads(err.split("PLUGINS=")[-1].splitlines()[0])
    want = EXPECTED[name]
    assert sorted(imported) == sorted(want["plugins"]), imported
    for mod, path in imported.items():  # imported at validate time, from the example's folder
        assert path == str(EXAMPLES / name / f"{mod}.py"), (mod, path)

    rc, out, err = _wait(job)
    assert rc == 0, err[-3000:]
    cfg = yaml.safe_load(out)
    assert cfg["experiment_name"] == name
    for key, value in want.items():
        assert _get(cfg, key) == value, (key, _get(cfg, key))
    agent = cfg["workflow"]["kwargs"].get("agent")
    if agent:  # the agent the workflow calls lives in a module the CLI imported at validate time
        assert agent.split(":")[0] in imported
    command = cfg["workflow"]["kwargs"].get("command")
    if command:  # the command runs a module of this folder (on the run's PYTHONPATH)
        module = shlex.split(command)[shlex.split(command).index("-m") + 1]
        assert module in imported and (EXAMPLES / name / f"{module}.py").is_file()
    data = cfg["dataset"]["train_path"]  # where the example's data script writes by default
    assert data == "data/gsm8k/train.jsonl", data
