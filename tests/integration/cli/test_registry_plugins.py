"""Plugins through the real CLI: a module under tests/ registers an advantage estimator, a workflow
and a reward with the public decorators, is named in ``plugins=[...]``, and is validated by
`areal validate-config` and trained by `areal train` (CLI → local launcher → torchrun trainer,
rollout worker and reward workers), with no edit to the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support_paths import SUPPORT

pytestmark = pytest.mark.timeout(400)
HERE = SUPPORT
PLUGIN = "plugins=[registry_plugin]"
# Runs the real entry point, then reports whether torch got imported (plugins keep it lazy).
PROBE = ("import sys\nfrom areal_cli.cli.main import main\ncode = main(sys.argv[1:])\n"
         "sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules))\nsys.exit(code)\n")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1",
           "COLUMNS": "200", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("AREAL_PLUGINS", None)
    env.pop("AREAL_DEBUG", None)
    env.update(extra)
    return env


def validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, "validate-config", *args], capture_output=True,
                          text=True, env=_env(), timeout=120, check=False)


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("TORCH=")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_validate_config_accepts_plugin_names_without_importing_torch():
    p = validate(PLUGIN, "algo.adv_estimator=marked_grpo", "workflow.name=marked_rlvr",
                 "workflow.reward=marked_numeric")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "valid configuration" in p.stdout and "TORCH=False" in p.stderr


@pytest.mark.parametrize("args,path,words", [
    # without the plugin the names are unknown, and the message lists the registered ones
    (["algo.adv_estimator=marked_grpo"], "algo.adv_estimator", ["grpo, drgrpo", "plugins=[...]"]),
    (["workflow.name=marked_rlvr"], "workflow.name", ["rlvr, multi_turn, agent"]),
    # with it, an unknown name still fails and the list includes the plugin's names
    ([PLUGIN, "algo.adv_estimator=nope"], "algo.adv_estimator", ["marked_grpo", "marked_gae"]),
    ([PLUGIN, "workflow.name=nope"], "workflow.name", ["marked_rlvr"]),
    ([PLUGIN, "workflow.reward=nope"], "workflow.reward", ["numeric", "marked_numeric"]),
    # a requirement comes from the declaration: marked_gae declares needs_values, so it needs a critic
    ([PLUGIN, "algo.adv_estimator=marked_gae"], "algo.use_critic", ["needs_values"]),
    (["plugins=[no_such_plugin_xyz]"], "plugins[0]", ["no_such_plugin_xyz", "PYTHONPATH"]),
])
def test_validate_config_refuses_with_one_line(args, path, words):
    line = one_error_line(validate(*args))
    assert f"{path}:" in line, line
    for w in words:
        assert w in line, line


def test_plugin_estimator_workflow_and_reward_train(tmp_path, tiny_model_dir):
    """Two steps of the embedded CPU default with all three plugins selected. Each leaves marker
    lines from the process that runs it, so the test shows the plugin reached every child."""
    marker = tmp_path / "marker.jsonl"
    steps, batch, group = 2, 2, 2
    args = {"cluster.fileroot": tmp_path, "model.path": tiny_model_dir, "experiment_name": "plug",
            "trial_name": "t0", "algo.adv_estimator": "marked_grpo", "workflow.name": "marked_rlvr",
            "workflow.reward": "marked_numeric", "trainer.total_steps": steps, "trainer.sft_warmup_steps": 0,
            "trainer.eval_every": 0, "trainer.recover_every": 0, "trainer.save_every": 0,
            "algo.batch_size": batch, "rollout.group_size": group, "rollout.gconfig.max_new_tokens": 6,
            "dataset.train_size": 50, "dataset.test_size": 4, "dataset.max_prompt_len": 256,
            "stats.live": "false"}
    p = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", PLUGIN,
                        *(f"{k}={v}" for k, v in args.items())],
                       capture_output=True, text=True, env=_env(AREAL_TEST_PLUGIN_MARKER=str(marker)),
                       timeout=380, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = [json.loads(ln) for ln in (tmp_path / "runs/plug/t0/metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if m.get("kind") == "train"]) == steps
    marks = [json.loads(ln) for ln in marker.read_text().splitlines()]
    est = [m for m in marks if m["kind"] == "adv_estimator"]
    wf = [m for m in marks if m["kind"] == "workflow"]
    rew = [m for m in marks if m["kind"] == "reward"]
    # the estimator ran once per step in the trainer rank, on the whole batch
    assert [(m["rank"], m["rows"]) for m in est] == [("0", batch * group)] * steps, est
    trainer_pids = {m["pid"] for m in est}
    # the workflow ran in the spawned rollout worker, with the trainer's generation config (EOS stop)
    assert len(wf) >= steps * batch and trainer_pids.isdisjoint(m["pid"] for m in wf), wf
    assert all(m["stop_ids"] for m in wf), wf
    # the reward ran in the reward pool's spawned workers, once per sample at least
    assert len(rew) >= steps * batch * group
    assert {m["pid"] for m in rew}.isdisjoint(trainer_pids | {m["pid"] for m in wf}), rew
