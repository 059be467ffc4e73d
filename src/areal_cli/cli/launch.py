"""``areal train`` after validation, in the CLI process: prepare, launch, watch, summarise.

1. prepare the built-in model, or fetch a hub model into the HF cache (launcher=local: here, before
   validation reads its config.json; cluster launchers: each node fetches it, this process pins the
   revision to a commit), check the dataset files (before anything starts);
2. check the run dir's storage (writable, then areal_cli.storage's probe unless ``skip_storage_check``);
3. write ``config.yaml`` and ``launch.json`` (layout + model path) into the run dir;
4. hand the layout to the launcher named by ``launcher.name`` and show the live view while it runs;
5. print the summary table and write ``learning_curve.png`` and ``summary.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError, StorageError
from areal_cli.storage import run_storage_check

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

# Files a fresh (resume=none) run replaces; anything else in the run dir is left alone.
RUN_STATE = ("metrics.jsonl", "status.json", "servers", "recover", "checkpoints", "sft_warmup",
             "weight_sync", "tensorboard", "logs", "summary.json", "learning_curve.png", "wandb",
             "node_errors")


def check_run_dir_writable(run_dir: str) -> None:
    p = Path(run_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write_probe.{os.getpid()}"
        probe.write_bytes(b"areal")
        os.replace(probe, p / ".write_probe")
        (p / ".write_probe").unlink()
    except OSError as e:
        raise StorageError(f"run dir {run_dir} is not writable ({e.strerror or e}) "
                           "— fix: set cluster.fileroot to a writable directory") from e


def check_storage(cfg: ExperimentConfig, run_dir: str) -> None:
    """The run dir must be writable; then the shared-storage probe, unless ``skip_storage_check``."""
    check_run_dir_writable(run_dir)
    if cfg.skip_storage_check:
        return
    run_storage_check(cfg, run_dir)


def check_dataset_files(cfg: ExperimentConfig) -> None:
    """A missing local dataset file is an error before anything launches; a remote launcher reads the data
    on its nodes, so a path this machine cannot see is left to them (validate-config warned about it)."""
    from areal_cli.data.checks import check_dataset_paths

    check_dataset_paths(cfg.dataset, remote=cfg.launcher.name if cfg.launcher.name != "local" else None)


def prepare_run_dir(cfg: ExperimentConfig, run_dir: str) -> None:
    from areal_cli.cli.resume import AUTO_RESUME

    p = Path(run_dir)
    saved = (p / "recover" / "latest.json").exists()
    fresh = cfg.resume == "none" or (cfg.resume in AUTO_RESUME and not saved)
    if fresh and p.exists():
        stale = [name for name in RUN_STATE if (p / name).exists()]
        if stale:
            why = "resume=none" if cfg.resume == "none" else f"resume={cfg.resume} found no recover state"
            print(f"[areal] {why}: starting over in {run_dir} (replacing {', '.join(stale)})",
                  file=sys.stderr)
            for name in stale:
                q = p / name
                shutil.rmtree(q) if q.is_dir() and not q.is_symlink() else q.unlink()
    else:
        for name in ("status.json", "servers", "node_errors"):  # leftovers of the killed run are not live
            q = p / name
            if q.is_dir():
                shutil.rmtree(q)
            elif q.exists():
                q.unlink()
    p.mkdir(parents=True, exist_ok=True)


def check_engine_available(cfg: ExperimentConfig) -> None:
    """Refuse, before anything starts, a training backend this release can plan but not run."""
    from areal_cli.engines import get_engine_spec, trainable_engines

    if not get_engine_spec(cfg.engine.name).trainable:
        raise ConfigError("engine.name", f"the {cfg.engine.name!r} training backend is validated and planned "
                          "(validate-config, train --dry-run) but cannot train in this release",
                          f"train with engine={' or engine='.join(trainable_engines())}")


def fetches_on_nodes(cfg: ExperimentConfig) -> bool:
    """Whether ``launcher.name``'s nodes fetch a hub model themselves (slurm, ray, skypilot: one download per
    node into its HF cache) rather than this process (local, and any launcher that does not say so)."""
    from areal_cli.launchers.base import get_launcher

    return bool(getattr(get_launcher(cfg.launcher.name), "fetches_model_on_nodes", False))


def fetch_hub_model(cfg: ExperimentConfig) -> bool:
    """Download a hub ``model.path`` now when this process is the one that fetches it and it is not cached;
    when the launcher's nodes fetch it, download its config.json alone (kilobytes), so the plan is checked
    against the real architecture. True when it downloaded (validation then re-reads the facts)."""
    from areal_cli.errors import ArealError
    from areal_cli.models.hub import (
        cached_config,
        cached_snapshot,
        ensure_hub_config,
        ensure_hub_model,
        is_hub_id,
    )

    path, revision = cfg.model.path, cfg.model.revision or None
    if not is_hub_id(path):
        return False
    if fetches_on_nodes(cfg):
        if cached_config(path, revision):
            return False
        try:
            ensure_hub_config(path, revision)
        except ArealError:
            from areal_cli.plan.recipe import preset_facts_known

            if preset_facts_known(cfg):  # an offline submitter: the named preset's facts plan the run
                return False
            raise
        return True
    if cached_snapshot(path, revision):
        return False
    ensure_hub_model(path, revision)
    return True


def check_teacher(cfg: ExperimentConfig, *, fetch: bool) -> None:
    """A distillation teacher (``algo.distill.teacher_path``) must read the student's tokens: a mismatched
    tokenizer is one ConfigError here, before any server starts or run dir is made (the trainer checks
    again, for launchers whose nodes resolve the paths themselves)."""
    d = cfg.algo.distill
    if not d.enabled or cfg.algo.name == "sft":
        return
    from areal_cli.models.teacher import check_teacher_tokenizer, resolve_teacher_path
    from areal_cli.trainer.build import resolve_model_path

    teacher = resolve_teacher_path(d.teacher_path, fetch=fetch)
    student = resolve_model_path(cfg, fetch=fetch)
    if os.path.isdir(student) and os.path.isdir(teacher):
        check_teacher_tokenizer(student, teacher)


def check_reward_model_dir(cfg: ExperimentConfig, *, fetch: bool) -> None:
    """``workflow.reward_model`` must be a reward-model export that reads the policy's tokens: checked here,
    once the policy's dir is resolved, before any server starts (the trainer checks again)."""
    from areal_cli.config.algo import generates

    r = cfg.workflow.reward_model
    if not r.enabled or not generates(cfg.algo.name):
        return
    from areal_cli.models.teacher import resolve_teacher_path
    from areal_cli.plan.reward_model import KEY, check_export_dir, check_rm_tokenizer
    from areal_cli.trainer.build import resolve_model_path

    rm_dir = resolve_teacher_path(r.path, fetch=fetch, key=f"{KEY}.path", role="reward model")
    policy = resolve_model_path(cfg, fetch=fetch)
    if os.path.isdir(rm_dir):
        check_export_dir(rm_dir)
        if os.path.isdir(policy):
            check_rm_tokenizer(policy, rm_dir)


def run_train(cfg: ExperimentConfig, plan: Any | None = None, *, live: bool | None = None,
              overrides: list[str] | None = None, choice: Any | None = None) -> int:
    """Launch and supervise one experiment. Returns the exit code (0 success, 130 Ctrl-C).

    ``overrides``: the command line's, for the command that resumes the run after Ctrl-C or a failure;
    ``choice``: :func:`areal_cli.cli.resume.settle_run`'s verdict (settled here when not given)."""
    from areal_cli.cli.report import LiveView
    from areal_cli.cli.resume import after_stop_line, settle_run
    from areal_cli.errors import ArealError
    from areal_cli.launchers.base import get_launcher
    from areal_cli.trainer.build import layout_from_plan, resolve_model_path
    from areal_cli.config.io import save_config
    from areal_cli.trainer.entry import LAUNCH_FILE

    t0 = time.time()
    if choice is None:
        choice = settle_run(cfg)
    run_dir = cfg.run_dir()
    try:
        check_engine_available(cfg)
        layout = layout_from_plan(cfg, plan)
        launcher = get_launcher(cfg.launcher.name)
        launcher.preflight(cfg, layout)  # missing cluster tools fail here, before any preparation
        check_dataset_files(cfg)
        check_teacher(cfg, fetch=not getattr(launcher, "fetches_model_on_nodes", False))
        check_reward_model_dir(cfg, fetch=not getattr(launcher, "fetches_model_on_nodes", False))
        check_storage(cfg, run_dir)
    except BaseException:
        choice.release()  # nothing ran: no empty run dir stays behind
        raise
    prepare_run_dir(cfg, run_dir)
    on_nodes = bool(getattr(launcher, "fetches_model_on_nodes", False))
    model_path = resolve_model_path(cfg, fetch=not on_nodes)
    revision = cfg.model.revision
    if on_nodes and model_path == cfg.model.path:
        from areal_cli.models.hub import is_hub_id, pin_revision

        if is_hub_id(model_path):  # every node fetches this one commit, however late it starts
            revision = pin_revision(model_path, revision)
    config_path = save_config(cfg, os.path.join(run_dir, "config.yaml"))
    (Path(run_dir) / LAUNCH_FILE).write_text(json.dumps({"layout": layout.to_dict(), "model_path": model_path,
                                                         "model_revision": revision, "config": config_path,
                                                         "launched": t0}, indent=1))
    if choice.no_earlier_run:
        print(f"[areal] resume={cfg.resume}: no earlier run of {cfg.experiment_name} to continue; starting "
              f"{choice.name}", file=sys.stderr, flush=True)
    for line in (choice.resume_line(), choice.changed_line()):
        if line:
            print(f"[areal] {line}", file=sys.stderr, flush=True)
    print(f"[areal] run dir {run_dir}; logs in {run_dir}/logs", file=sys.stderr, flush=True)
    show = cfg.stats.live if live is None else live
    show = show and sys.stderr.isatty()
    total = int(cfg.trainer.total_steps)
    try:
        # Records older than this launch (a resumed run's earlier steps) are not shown again as if new.
        with LiveView(run_dir, total, title=f"areal train {cfg.experiment_name}/{cfg.trial_name}",
                      enabled=show, since=t0, sft_steps=int(cfg.trainer.sft_warmup_steps),
                      sft_only=cfg.algo.name == "sft") as view:
            on_tick = view.update if show else _progress_printer(run_dir, total, since=t0)
            rc = launcher.launch(cfg, layout, run_dir, model_path=model_path, model_revision=revision,
                                 on_tick=on_tick)
    except ArealError as e:  # main prints the error line; what to type next goes after it
        then = after_stop_line(run_dir, overrides, cfg.trial_name, int(cfg.trainer.recover_every))
        if then.startswith("to resume"):
            e.details = [*e.details, then]
        raise
    if rc == 0:
        finish_report(run_dir, wall_s=time.time() - t0)
    elif rc in (130, 143):  # Ctrl-C / SIGTERM
        then = after_stop_line(run_dir, overrides, cfg.trial_name, int(cfg.trainer.recover_every))
        print(f"[areal] {then}", file=sys.stderr, flush=True)
    return rc


def _progress_printer(run_dir: str, total: int, since: float | None = None) -> Any:
    """Without a terminal: one plain line per logged step (CI logs, pipes); ``since``: records older than
    that (a resumed run's earlier steps) are skipped."""
    from areal_cli.cli.report import MetricsTail

    tail = MetricsTail(Path(run_dir) / "metrics.jsonl", since=since)

    def tick() -> None:
        for r in tail.read_new():
            kind = r.get("kind")
            if kind == "train":
                print(f"[areal] step {r['step']}/{total} reward {r.get('reward/mean', 0):.3f} "
                      f"staleness {r.get('staleness/mean', 0) or 0:.2f} "
                      f"gen {r.get('perf/gen_tokens_per_s', 0):.0f} tok/s "
                      f"sync {r.get('perf/weight_sync_s', 0):.3f}s", file=sys.stderr, flush=True)
            elif kind == "eval" and r.get("phase") == "rm":
                print(f"[areal] eval @ step {r['step']} (rm): pairwise accuracy "
                      f"{r.get('eval/pairwise_accuracy', 0):.1%}", file=sys.stderr, flush=True)
            elif kind == "eval":
                print(f"[areal] eval @ step {r['step']} ({r.get('phase', 'rl')}): pass@1 "
                      f"{r.get('eval/pass@1', 0):.1%}", file=sys.stderr, flush=True)
            elif kind == "sft" and (r["step"] % 10 == 0 or r["step"] == 1):
                of = f"/{r['total']}" if r.get("total") else ""
                print(f"[areal] sft step {r['step']}{of} loss {r.get('sft/loss', 0):.3f}", file=sys.stderr, flush=True)
            elif kind == "rm" and (r["step"] % 10 == 0 or r["step"] == 1):
                of = f"/{r['total']}" if r.get("total") else ""
                print(f"[areal] rm step {r['step']}{of} loss {r.get('rm/loss', 0):.3f} pair accuracy "
                      f"{r.get('rm/accuracy', 0):.1%}", file=sys.stderr, flush=True)

    return tick


def finish_report(run_dir: str, wall_s: float) -> dict[str, Any]:
    """Summary table on stderr, summary.json and learning_curve.png in the run dir."""
    from rich.console import Console

    from areal_cli.cli.report import plot_learning_curve, summarize, summary_table

    summary = summarize(run_dir)
    summary["wall_s"] = round(wall_s, 1)
    png = plot_learning_curve(run_dir)
    if png:
        summary["learning_curve"] = png
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    console = Console(stderr=True)
    console.print(summary_table(summary))
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    warm = summary.get("accuracy_warm_start")
    if before is not None and after is not None and warm is not None and summary.get("steps"):
        console.print(f"held-out accuracy: before {before:.1%} → SFT warm start {warm:.1%} → after RL {after:.1%} "
                      f"({(after - before) * 100:+.1f} pts, RL {(after - warm) * 100:+.1f} pts) "
                      f"in {wall_s / 60:.1f} min")
    elif before is not None and after is not None:
        console.print(f"held-out accuracy: before {before:.1%} → after {after:.1%} "
                      f"({(after - before) * 100:+.1f} pts) in {wall_s / 60:.1f} min")
    return summary
