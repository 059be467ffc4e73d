"""Plan, validate, run and resume a sweep. The CLI command is a thin layer over these functions."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli.errors import ArealError, UsageError
from areal_cli.sweep.expand import expand_grid, optuna_distributions, split_overrides, trial_id
from areal_cli.sweep.manifest import RERUN_STATES, Manifest, Trial


def check_trial(fixed: list[str], overrides: list[str], name: str, tid: str) -> tuple[str, str, int]:
    """Validate one trial like ``areal validate-config`` would.

    Returns ``(reason, run_dir, n_processes)``; ``reason`` is empty when the trial is valid.
    """
    from areal_cli.plan.compose import explain_range, load_config, prepare
    from areal_cli.plan.validate import validate
    from areal_cli.errors import ConfigError

    prep = None
    try:
        prep = prepare([*fixed, *overrides, f"experiment_name={name}", f"trial_name={tid}"])
        cfg = load_config(prepared=prep)
        plan = validate(cfg)
    except ConfigError as e:
        return str(explain_range(e, prep) if prep is not None else e), "", 0
    except ArealError as e:
        return str(e), "", 0
    return "", cfg.run_dir(), plan_processes(plan)


def plan_processes(plan) -> int:
    """Processes (CPU "devices") a trial occupies on this machine."""
    return max(1, int(plan.n_devices_used))


def new_manifest(overrides: list[str], *, sweep_dir: str | None, metric: str, mode: str, launcher: str,
                 n_trials: int) -> Manifest:
    spec = split_overrides(overrides)
    if not spec.swept:
        raise UsageError("nothing to sweep: no override has several values — fix: give at least one sweep "
                         "override, e.g. algo.optim.lr=1e-6,3e-6")
    if mode not in ("max", "min"):
        raise UsageError(f"--mode {mode!r} is neither max nor min — fix: --mode max or --mode min")
    if spec.is_search and n_trials <= 0:
        raise UsageError("interval() sweeps run an optuna search, which needs a trial count — fix: pass "
                         "--n-trials N")
    name = f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    if sweep_dir is None:
        from areal_cli.plan.compose import load_config

        fileroot = os.path.expanduser(load_config(spec.fixed).cluster.fileroot)
        sweep_dir = os.path.join(fileroot, "sweeps", name)
    else:
        name = Path(sweep_dir).name or name
    m = Manifest(sweep_dir=str(Path(sweep_dir).resolve()), name=name, fixed=spec.fixed, swept=spec.swept,
                 swept_keys=spec.swept_keys, metric=metric, mode=mode, launcher=launcher,
                 search=spec.is_search, n_trials=n_trials)
    if not spec.is_search:
        grid = expand_grid(spec.swept)
        if n_trials > 0:
            grid = grid[:n_trials]
        for ovs in grid:
            m.trials.append(Trial(id=trial_id(ovs), overrides=ovs))
    return m


def validate_all(m: Manifest, strict: bool) -> dict[str, int]:
    """Validate every pending trial before any runs. Returns processes per trial id."""
    cost: dict[str, int] = {}
    for t in m.trials:
        if t.status not in RERUN_STATES:
            continue
        reason, run_dir, n = check_trial(m.fixed, t.overrides, m.name, t.id)
        if reason:
            t.status, t.reason = "invalid", reason
        else:
            t.run_dir, cost[t.id] = run_dir, n
    invalid = [t for t in m.trials if t.status == "invalid"]
    if strict and invalid:
        raise UsageError(f"--strict: {len(invalid)} invalid trial(s), first: {invalid[0].id}: {invalid[0].reason}")
    return cost


def parallelism(cost: dict[str, int], cpus: int | None, max_parallel: int | None) -> int:
    per_trial = max(cost.values(), default=1)
    budget = cpus or os.cpu_count() or 1
    n = max(1, budget // per_trial)
    return min(n, max_parallel) if max_parallel else n


def run_grid(m: Manifest, *, strict: bool, cpus: int | None, max_parallel: int | None,
             slurm_params: dict | None, on_update: Callable[[Trial], None]) -> None:
    from areal_cli.sweep.runner import run_local, run_slurm

    cost = validate_all(m, strict)
    m.save()
    todo = [t for t in m.trials if t.status in RERUN_STATES]
    if not todo:
        return
    par = parallelism(cost, cpus, max_parallel)
    if m.launcher == "slurm":
        run_slurm(m, todo, max_parallel or len(todo), slurm_params or {}, on_update)
    else:
        run_local(m, todo, par, on_update)


def run_search(m: Manifest, *, cpus: int | None, max_parallel: int | None, seed: int,
               on_update: Callable[[Trial], None]) -> None:
    """Optuna ask/tell over the sweep's distributions; finished trials of a resumed search are told
    back first so the sampler continues where it stopped."""
    import optuna

    from areal_cli.sweep.runner import run_local

    dists = optuna_distributions(m.swept)
    direction = "maximize" if m.mode == "max" else "minimize"
    study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=seed))
    for t in m.trials:
        if t.status == "done" and isinstance(t.metrics.get(m.metric), (int, float)):
            params = {k: _external(d, t.value_of(k)) for k, d in dists.items()}
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                      value=float(t.metrics[m.metric])))
    for t in m.trials:  # unfinished trials of a killed search rerun with their params
        if t.status in RERUN_STATES:
            t.status = "pending"
    while len(m.trials) < m.n_trials or any(t.status == "pending" for t in m.trials):
        batch = [t for t in m.trials if t.status == "pending"]
        asked = {}
        while len(m.trials) < m.n_trials and len(batch) < (max_parallel or 1):
            ot = study.ask(dists)
            ovs = [f"{k}={v}" for k, v in ot.params.items()]
            t = Trial(id=trial_id(ovs), overrides=ovs)
            m.trials.append(t)
            batch.append(t)
            asked[t.id] = ot
        cost = validate_all(m, strict=False)
        m.save()
        runnable = [t for t in batch if t.status == "pending"]
        run_local(m, runnable, parallelism(cost, cpus, max_parallel), on_update)
        for t in batch:
            ot = asked.get(t.id)
            if ot is None:
                continue
            value = t.metrics.get(m.metric)
            if t.status == "done" and isinstance(value, (int, float)):
                study.tell(ot, float(value))
            else:
                study.tell(ot, state=optuna.trial.TrialState.FAIL)


def _external(dist, raw: str):
    """The optuna parameter value a trial's override text stands for."""
    import optuna

    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return next((c for c in dist.choices if str(c) == raw), dist.choices[0])
    if isinstance(dist, (optuna.distributions.IntUniformDistribution, optuna.distributions.IntLogUniformDistribution)):
        return int(float(raw))
    return float(raw)
