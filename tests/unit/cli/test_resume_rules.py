"""cli/resume.py on real configs and run dirs: default names, the latest run, what a resume may change, the
resume command; and the console's metrics tail skipping an earlier launch's records."""

from __future__ import annotations

import json
import os
import shlex
import time

import pytest

from areal_cli.cli.resume import (
    HARMLESS,
    config_changes,
    config_tree,
    is_harmless,
    latest_trial,
    new_trial_name,
    resume_command,
    settle_run,
)
from areal_cli.plan.compose import load_config
from areal_cli.errors import ConfigError
from areal_cli.config.io import save_config


def _cfg(root, *extra):
    return load_config([f"cluster.fileroot={root}", "experiment_name=e", *extra])


def _fake_run(root, trial: str, launched: float, step: int | None = 2, *extra: str):
    """A run dir as `areal train` leaves it: config.yaml, launch.json, and a recover state at ``step``."""
    cfg = _cfg(root, f"trial_name={trial}", *extra)
    run = root / "runs" / "e" / trial
    save_config(cfg, run / "config.yaml")
    (run / "launch.json").write_text(json.dumps({"launched": launched}))
    if step is not None:
        state = run / "recover" / f"step_{step:06d}"
        state.mkdir(parents=True)
        (state / "trainer.json").write_text(json.dumps({"step": step}))
        (run / "recover" / "latest.json").write_text(json.dumps({"step": step, "path": state.name}))
    return run


def test_default_names_are_timestamps_unique_within_one_second(tmp_path):
    exp = tmp_path / "runs" / "e"
    now = time.time()
    names = [new_trial_name(exp, claim=True, now=now) for _ in range(3)]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    assert names == [stamp, f"{stamp}-2", f"{stamp}-3"]
    assert all((exp / n).is_dir() for n in names)
    assert new_trial_name(exp, claim=False, now=now) == f"{stamp}-4" and not (exp / f"{stamp}-4").exists()


def test_an_unnamed_run_is_named_once_and_a_named_one_keeps_its_name(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.trial_name == ""
    choice = settle_run(cfg)
    assert cfg.trial_name and choice.name == f"e/{cfg.trial_name}" and choice.step is None
    assert (tmp_path / "runs" / "e" / cfg.trial_name).is_dir()
    choice.release()  # a pre-launch check failed: the empty dir goes
    assert not (tmp_path / "runs" / "e" / cfg.trial_name).exists()
    named = _cfg(tmp_path, "trial_name=mine")
    settle_run(named)
    assert named.trial_name == "mine"


def test_resume_auto_without_a_name_continues_the_latest_launched_run(tmp_path):
    _fake_run(tmp_path, "20261101-000000", launched=200.0)
    _fake_run(tmp_path, "20261102-000000", launched=100.0)  # a later name, launched earlier
    assert latest_trial(tmp_path / "runs" / "e") == "20261101-000000"
    cfg = _cfg(tmp_path, "resume=auto")
    choice = settle_run(cfg)
    assert cfg.trial_name == "20261101-000000" and choice.picked_latest and choice.step == 2
    assert choice.resume_line() == (f"resuming e/20261101-000000 (the latest run of e) from step 2 (checkpoint "
                                    f"{tmp_path / 'runs/e/20261101-000000/recover/step_000002'})")
    fresh = _cfg(tmp_path / "other", "resume=auto")
    assert settle_run(fresh).no_earlier_run and fresh.trial_name  # nothing to continue: a new run


def test_a_resume_that_changes_what_the_checkpoint_holds_is_refused_with_the_diff(tmp_path):
    _fake_run(tmp_path, "t", 1.0, 2, "algo.batch_size=2", "trainer.total_steps=4")
    cfg = _cfg(tmp_path, "trial_name=t", "resume=auto", "algo.batch_size=4", "trainer.total_steps=6")
    with pytest.raises(ConfigError) as e:
        settle_run(cfg)
    line = str(e.value)
    assert line.startswith("resume: e/t's checkpoint (step 2) depends on settings that changed since the "
                           "checkpoint: algo.batch_size 2 → 4 — fix: resume with the old values, start a new "
                           "run (trial_name=")
    assert line.endswith("), or resume=force") and "total_steps" not in line
    forced = _cfg(tmp_path, "trial_name=t", "resume=force", "algo.batch_size=4", "trainer.total_steps=6")
    choice = settle_run(forced)
    assert choice.step == 2
    assert choice.changed_line() == "resume: changed: algo.batch_size 2 → 4, trainer.total_steps 4 → 6"


def test_harmless_changes_are_listed_and_accepted(tmp_path):
    _fake_run(tmp_path, "t", 1.0, 2, "trainer.total_steps=60", "trainer.eval_every=10", "stats.live=true",
              "launcher.max_server_restarts=3")
    cfg = _cfg(tmp_path, "trial_name=t", "resume=auto", "trainer.total_steps=200", "trainer.eval_every=7",
               "stats.live=false", "launcher.max_server_restarts=1")
    choice = settle_run(cfg)
    assert choice.changed_line() == ("resume: changed: launcher.max_server_restarts 3 → 1, stats.live true → false, "
                                     "trainer.eval_every 10 → 7, trainer.total_steps 60 → 200")
    # Every table key is a real config path, and nothing the checkpoint holds is in it.
    paths = set(_flatten_keys(config_tree(cfg)))
    for key in HARMLESS:
        assert any(p == key or p.startswith(key + ".") for p in paths), key
    for key in ("model.path", "algo.batch_size", "rollout.group_size", "allocation_mode.spec", "engine.name",
                "model.lora.rank", "engine.dtype", "algo.optim.lr", "trainer.sft_warmup_steps", "seed"):
        assert not is_harmless(key), key


def _flatten_keys(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _flatten_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_a_key_older_configs_lack_counts_only_when_it_leaves_the_default(tmp_path):
    new = config_tree(_cfg(tmp_path))
    old = json.loads(json.dumps(new))
    del old["trainer"]["keep_checkpoints"], old["rollout"]["group_size"]
    assert config_changes(old, new) == []
    new["rollout"]["group_size"] = 3
    assert [c[0] for c in config_changes(old, new)] == ["rollout.group_size"]


def test_resume_command_keeps_the_overrides_and_replaces_name_and_resume(monkeypatch, tmp_path):
    monkeypatch.delenv("AREAL_CONFIG_DIR", raising=False)
    cmd = resume_command(["algo=ppo", "trial_name=old", "resume=none", "launcher.slurm.setup=[module load x]"],
                         "20261129-073015")
    assert shlex.split(cmd) == ["areal", "train", "algo=ppo", "launcher.slurm.setup=[module load x]",
                                "trial_name=20261129-073015", "resume=auto"]
    confdir = tmp_path / "conf"
    (confdir / "experiment").mkdir(parents=True)
    monkeypatch.setenv("AREAL_CONFIG_DIR", str(confdir))
    assert shlex.split(resume_command([], "t"))[:3] == ["areal", "--config-dir", str(confdir)]


def test_metrics_tail_skips_an_earlier_launch_and_follows_the_trainers_rewrite(tmp_path):
    from areal_cli.cli.report import MetricsTail

    path = tmp_path / "metrics.jsonl"
    old = [{"kind": "train", "step": s, "time": 100.0 + s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    tail = MetricsTail(path, since=200.0)
    assert tail.read_new() == []
    # The resumed trainer cuts the file back to step 2 (a new file, shorter), then logs step 3 anew.
    tmp = tmp_path / "m.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in old[:2]))
    os.replace(tmp, path)
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "train", "step": 3, "time": 201.0}) + "\n")
    assert [(r["step"], r["time"]) for r in tail.read_new()] == [(3, 201.0)]
