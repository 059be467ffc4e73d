"""What a user sees during and after a run (cli/report.py), fed by real runs' ``metrics.jsonl``:

- an RL run with an SFT warm start: while SFT runs, the live table shows the SFT step out of its total,
  the loss the trainer logged and an ETA at the SFT step rate; with the first RL step it switches to the
  RL columns;
- ``algo=sft``: the table reads "SFT" with step/total, its evaluations are labelled ``sft`` (not ``rl``) in
  the records and the plain progress lines, and its summary claims no RL gain;
- the summary table: accuracies as percents, gains in points, never a raw fraction;
- (riding on the same run) ``engine.max_tokens_per_mb=auto`` reaches the trainer as the int validation chose.

The records are replayed into a growing file one at a time, as the trainer writes them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_runs import _env, _overrides, _records

from areal_cli.cli.report import LiveView, format_summary_value, summarize, summary_table

pytestmark = pytest.mark.timeout(400)

SFT_STEPS = 4
ETA = re.compile(r"\b\d+:\d\d\b")


def _train(root: Path, model_dir: str, **extra: object) -> tuple[Path, str]:
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train",
                          *_overrides(root, model_dir, **extra)],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return root / "runs" / "itest" / "t0", res.stdout + res.stderr


@pytest.fixture(scope="module")
def warm_start_run(tmp_path_factory, tiny_model_dir):
    """2 RL steps after a 4-step SFT warm start."""
    return _train(tmp_path_factory.mktemp("warm"), tiny_model_dir, **WARM)


# engine.max_tokens_per_mb=auto: test_auto_budget_reaches_the_trainer reads what validation chose for it.
WARM = {"trainer.sft_warmup_steps": SFT_STEPS, "trainer.total_steps": 2, "trainer.eval_every": 2,
        "trainer.sft_batch_size": 4, "engine.max_tokens_per_mb": "auto"}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir):
    return _train(tmp_path_factory.mktemp("sft"), tiny_model_dir, **{
        "algo": "sft", "trainer.total_steps": 4, "trainer.eval_every": 2})


def _text(view: LiveView) -> str:
    from rich.console import Console

    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(view.render())
    return console.export_text()


def _replay(records: list[dict], tmp_path: Path, view_kw: dict):
    """A LiveView over a file that grows by one real record at a time; yields (record, rendered text)."""
    run_dir = tmp_path / "replay"
    run_dir.mkdir()
    view = LiveView(str(run_dir), enabled=False, **view_kw)
    with open(run_dir / "metrics.jsonl", "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            view.update()
            yield rec, _text(view)


def _header(text: str) -> list[str]:
    return text.splitlines()[2].replace("┃", "|").split("|")


def test_live_view_shows_sft_loss_step_and_eta_then_rl_columns(warm_start_run, tmp_path):
    run_dir, _ = warm_start_run
    records = _records(run_dir)
    sft = [r for r in records if r["kind"] == "sft"]
    assert [r["step"] for r in sft] == list(range(1, SFT_STEPS + 1))
    assert all(r["total"] == SFT_STEPS for r in sft), sft  # the trainer says how many SFT steps there are
    seen_sft, seen_rl = 0, 0
    # total_steps and sft_steps as launch.py passes them; the SFT total also comes from the records.
    for rec, text in _replay(records, tmp_path, {"total_steps": 2, "sft_steps": SFT_STEPS}):
        header = " ".join(_header(text))
        if rec["kind"] == "sft" and not seen_rl:
            assert "SFT warm start" in text and "loss" in header and "SFT ETA" in header, text
            assert f"{rec['step']}/{SFT_STEPS}" in text, text
            assert f"{rec['sft/loss']:.3f}" in text, text  # the loss this step logged
            if rec["step"] >= 2:  # two points make a rate
                assert ETA.search(text.split("\n", 3)[3]), text
            seen_sft += 1
        elif rec["kind"] == "train":
            assert "reward" in header and "staleness" in header and "SFT" not in text, text
            assert f"{rec['step']}/2" in text, text
            seen_rl += 1
    assert seen_sft == SFT_STEPS and seen_rl == 2


def test_sft_run_labels_and_summary(sft_run, tmp_path):
    run_dir, out = sft_run
    records = _records(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and all(r.get("phase") == "sft" for r in evals), evals
    assert "(rl)" not in out and "(sft): pass@1" in out, out[-3000:]
    assert "sft step 1/4 loss" in out, out[-3000:]
    texts = [t for rec, t in _replay(records, tmp_path, {"total_steps": 4, "sft_only": True})
             if rec["kind"] == "sft"]
    assert texts and all("SFT" in t and "warm start" not in t and "reward" not in t for t in texts)
    assert "4/4" in texts[-1] and " ETA" in " ".join(_header(texts[-1]))
    summary = summarize(run_dir)
    assert "rl_gain" not in summary and "accuracy_warm_start" not in summary, summary


def test_summary_units(warm_start_run):
    run_dir, out = warm_start_run
    summary = summarize(run_dir)
    assert "rl_gain" in summary and "accuracy_after" in summary, summary
    from rich.console import Console

    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    console.print(summary_table(summary))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.export_text().splitlines() if line.count("│") == 3}
    for key, shown in rows.items():
        if key.startswith(("accuracy", "pass@")):
            assert re.fullmatch(r"\d+\.\d%", shown), (key, shown)
    assert re.fullmatch(r"[+-]\d+\.\d pts", rows["rl_gain"]), rows
    assert rows["rl_gain"] == f"{summary['rl_gain'] * 100:+.1f} pts"
    assert re.search(r"RL [+-]\d+\.\d pts\)", out), out[-2000:]
    assert format_summary_value("accuracy_after", 0.905) == "90.5%"
    assert format_summary_value("rl_gain", 0.123) == "+12.3 pts"


def test_auto_budget_reaches_the_trainer(warm_start_run, tiny_model_dir):
    """The run's config.yaml holds the int that validation chose for ``auto``, and the trainer split each step
    into the micro-batches the plan predicted with it."""
    import yaml

    from areal_cli.cli.common import compose_and_validate

    run_dir, _ = warm_start_run
    cfg, plan = compose_and_validate(_overrides(run_dir.parents[2], tiny_model_dir, **WARM))
    chosen = next(a for a in plan.auto if a.path == "engine.max_tokens_per_mb")
    assert isinstance(chosen.value, int) and plan.train.micro_batch.auto
    written = yaml.safe_load((run_dir / "config.yaml").read_text())["engine"]["max_tokens_per_mb"]
    assert written == chosen.value == cfg.engine.max_tokens_per_mb
    steps = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert steps and all(r["train/n_micro_batches"] == plan.train.micro_batch.n_micro_batches for r in steps)
