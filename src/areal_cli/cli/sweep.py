"""``areal sweep``: Hydra sweep syntax over any config group; local or SLURM-array execution.

No torch here: trials are validated in-process (config + allocation only) and run as subprocesses.
"""

from __future__ import annotations

from typing import Optional

import typer

HELP = """Run many `areal train` trials from Hydra sweep overrides.

Examples:
  areal sweep algo.optim.lr=1e-4,3e-4 algo=grpo,dapo trainer.total_steps=10
  areal sweep seed=range(1,5) --max-parallel 2
  areal sweep 'algo.optim.lr=tag(log,interval(1e-5,1e-3))' --n-trials 8    (optuna search)
  areal sweep algo=grpo,rloo launcher=slurm                                  (SLURM job array)
  areal sweep --resume ~/.cache/areal/sweeps/sweep-20261121-120000
"""


def sweep(
    overrides: Optional[list[str]] = typer.Argument(None, help="Hydra overrides; a,b / range() / choice() / glob() / interval() sweep."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the trials and their validation status; run nothing."),
    strict: bool = typer.Option(False, "--strict", help="Stop if any trial is invalid (default: skip it)."),
    resume: Optional[str] = typer.Option(None, "--resume", help="Rerun the unfinished or failed trials of SWEEP_DIR."),
    metric: str = typer.Option("accuracy_after", "--metric", help="Key of the run's summary.json to rank trials and plot (accuracy_after, reward_last, samples_per_s_avg, ...)."),
    mode: str = typer.Option("max", "--mode", help="max or min."),
    max_parallel: Optional[int] = typer.Option(None, "--max-parallel", help="Trials at once (SLURM: array concurrency)."),
    cpus: Optional[int] = typer.Option(None, "--cpus", help="Local CPU budget (default: all cores)."),
    n_trials: int = typer.Option(0, "--n-trials", help="Optuna trials for interval() sweeps; caps grid size otherwise."),
    seed: int = typer.Option(0, "--seed", help="Seed of the optuna sampler."),
    sweep_dir: Optional[str] = typer.Option(None, "--sweep-dir", help="Where the manifest, results and trial logs go."),
) -> None:
    from rich.console import Console

    from areal_cli.sweep import results
    from areal_cli.sweep.core import new_manifest, run_grid, run_search, validate_all
    from areal_cli.sweep.manifest import Manifest

    console = Console()
    if resume:
        if overrides:
            from areal_cli.errors import UsageError

            raise UsageError("--resume takes the sweep's own overrides from its manifest — fix: pass no "
                             "overrides with --resume")
        m = Manifest.load(resume)
    else:
        ovs = list(overrides or [])
        launcher = "slurm" if "launcher=slurm" in ovs else "local"
        ovs = [o for o in ovs if o not in ("launcher=slurm", "launcher=local")]
        m = new_manifest(ovs, sweep_dir=sweep_dir, metric=metric, mode=mode, launcher=launcher, n_trials=n_trials)

    def on_update(t) -> None:
        console.print(f"[dim]{t.id}[/] {' '.join(t.overrides)} → [bold]{t.status}[/]"
                      + (f" {m.metric}={t.metrics.get(m.metric)}" if t.status == "done" else "")
                      + (f" [red]{t.reason}[/]" if t.status == "failed" else ""))

    if dry_run:
        validate_all(m, strict)
        for t in m.trials:
            if t.status == "pending":
                t.status = "valid"  # shown only; a dry run saves no manifest
        console.print(results.render_table(m))
        bad = [t for t in m.trials if t.status == "invalid"]
        console.print(f"{len(m.trials)} trial(s), {len(bad)} invalid. Nothing was run (--dry-run).")
        _refuse_all_invalid(m)
        return
    m.save()
    console.print(f"sweep dir: [bold]{m.sweep_dir}[/]  ({len(m.trials) or m.n_trials} trials, launcher {m.launcher})")
    if m.search:
        run_search(m, cpus=cpus, max_parallel=max_parallel, seed=seed, on_update=on_update)
    else:
        run_grid(m, strict=strict, cpus=cpus, max_parallel=max_parallel,
                 slurm_params=_slurm_params(m) if m.launcher == "slurm" else None, on_update=on_update)
    m.save()
    console.print(results.render_table(m))
    _refuse_all_invalid(m)
    csv_path = results.write_csv(m)
    png = results.plot(m)
    console.print(f"results: {csv_path}" + (f", plot: {png}" if png else ""))
    best = results.best_trial(m)
    if best is not None:
        console.print(f"[bold green]best[/] {best.id}: {' '.join(best.overrides)} "
                      f"{m.metric}={best.metrics.get(m.metric)}  run dir {best.run_dir}")
    failed = [t for t in m.trials if t.status == "failed"]
    if failed:
        console.print(f"[red]{len(failed)} trial(s) failed[/]; rerun them with: areal sweep --resume {m.sweep_dir}")
        raise typer.Exit(1)


def _refuse_all_invalid(m) -> None:
    """No valid trial: nothing can run, so the sweep is a failure (exit 1) naming the first reason."""
    if m.trials and all(t.status == "invalid" for t in m.trials):
        from areal_cli.errors import ArealError

        # The first trial's own error ends the line, with its fix: one "— fix:" per line.
        raise ArealError(f"all {len(m.trials)} trials of the sweep are invalid, so nothing would run; the "
                         f"first one's error: {m.trials[0].reason}")


def _slurm_params(m) -> dict:
    """submitit parameters from the sweep's composed launcher.slurm section."""
    from areal_cli.plan.compose import load_config

    s = load_config(m.fixed).launcher.slurm
    params = {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": s.cpus_per_task, "mem_gb": s.mem_gb,
              "timeout_min": s.time_min}
    if s.partition:
        params["slurm_partition"] = s.partition
    if s.account:
        params["slurm_account"] = s.account
    return params


def register(app) -> None:
    from areal_cli.cli.main import groups_epilog

    app.command("sweep", help=HELP, epilog=groups_epilog())(sweep)
