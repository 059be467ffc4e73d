"""Naming a run and resuming one, in the CLI process, before anything launches.

- **Names.** A run whose ``trial_name`` is unset is named by its start time, ``YYYYMMDD-HHMMSS`` (``-2``,
  ``-3``, … after it when another run took that second), and the name is claimed by creating the run dir,
  so two ``areal train`` never share one. The name is written into ``config.yaml``, which every node,
  rank and SLURM requeue reads, so it is chosen once. ``resume=auto`` (or ``force``) without a name
  continues the experiment's latest run: the one launched last (``launch.json``'s ``launched``).
- **What a resume may change.** The new config is compared with the run dir's ``config.yaml`` (what the
  last launch trained with). A key in :data:`HARMLESS` may change; any other change (model, algorithm,
  batch shape, allocation, engine, LoRA, dtype, data, seed, …) is refused with the diff unless
  ``resume=force``. docs/train.md ("What a resume may change") shows the table.
- :func:`resume_command`: the command that resumes this run, printed after Ctrl-C or a failure.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

AUTO_RESUME = ("auto", "force")  # continue the run dir's latest recover state; force skips the check
NAME_FORMAT = "%Y%m%d-%H%M%S"

# The keys a resume may change: how the run goes on from here, not what its checkpoint holds. A key
# matches itself and everything under it. Every other key is one the checkpoint depends on.
HARMLESS: dict[str, str] = {
    "trainer.total_steps": "how far the run goes (a decaying lr schedule stretches to the new end)",
    "trainer.total_epochs": "how far the run goes",
    "trainer.eval_every": "evaluation cadence",
    "trainer.eval_n_samples": "what an evaluation reports",
    "trainer.save_every": "HF export cadence",
    "trainer.recover_every": "recover-state cadence",
    "trainer.keep_checkpoints": "how many exports and recover states are kept",
    "dataset.eval_size": "how many held-out items an evaluation uses",
    "dataset.test_path": "the held-out data",
    "rollout.eval_gconfig": "how evaluations generate",
    "rollout.request_timeout_s": "client patience",
    "rollout.request_retries": "client patience",
    "rollout.routing": "which server takes a request",
    "rollout.max_concurrent_rollouts": "how many episodes run at once (the staleness bound still holds)",
    "stats": "logging",
    "launcher": "how processes start and are supervised (launcher, timeouts, restarts, env, server flags)",
    "cluster.gpu_memory_gb": "the memory estimate",
    "cluster.hardware": "the memory estimate and the plan",
    "skip_storage_check": "the pre-launch storage probe",
}
# They name the run dir (or are the resume itself): equal by construction, or meant to differ.
IGNORED = ("resume", "experiment_name", "trial_name", "cluster.fileroot")


@dataclass
class RunChoice:
    """What :func:`settle_run` decided for this launch."""

    name: str                                   # experiment/trial
    picked_latest: bool = False                 # trial_name unset, resume=auto took the latest run
    step: int | None = None                     # the recover state's step (None: a fresh start)
    checkpoint: str | None = None               # its directory
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)  # accepted changes
    no_earlier_run: bool = False                # resume=auto without a name found no run to continue
    claimed: Path | None = None                 # the new run dir made to hold the name
    made: list[Path] = field(default_factory=list)  # the dirs above it that claiming created, deepest first

    def release(self) -> None:
        """Give the name back when the launch stopped before using its dir (a pre-launch check failed)."""
        for d in [self.claimed, *self.made] if self.claimed is not None else []:
            try:
                d.rmdir()  # only while empty: a run of the same experiment started meanwhile keeps it
            except OSError:
                return

    def resume_line(self) -> str | None:
        if self.step is None:
            return None
        which = f" (the latest run of {self.name.split('/')[0]})" if self.picked_latest else ""
        return f"resuming {self.name}{which} from step {self.step} (checkpoint {self.checkpoint})"

    def changed_line(self) -> str | None:
        if not self.changed:
            return None
        return "resume: changed: " + ", ".join(f"{k} {_show(a)} → {_show(b)}" for k, a, b in self.changed)


# ---------------------------------------------------------------- names

def experiment_dir(cfg: ExperimentConfig) -> Path:
    return Path(os.path.expanduser(cfg.cluster.fileroot)) / "runs" / cfg.experiment_name


def new_trial_name(exp_dir: Path, *, claim: bool, now: float | None = None) -> str:
    """``YYYYMMDD-HHMMSS`` of ``now``, with ``-2``, ``-3``, … when a run dir of that name exists. ``claim``
    creates the dir, atomically, so a run started in the same second elsewhere takes the next name."""
    base = time.strftime(NAME_FORMAT, time.localtime(time.time() if now is None else now))
    for i in range(1, 10_000):
        name = base if i == 1 else f"{base}-{i}"
        p = exp_dir / name
        if not claim:
            if not p.exists():
                return name
            continue
        try:
            p.mkdir(parents=True)
            return name
        except FileExistsError:
            continue
        except OSError:  # not creatable here: the storage check says why, with the fix
            return name
    raise ConfigError("trial_name", f"{exp_dir} holds 10000 runs named {base}-N", "set trial_name=<a name>")


def launched_at(run_dir: Path) -> float | None:
    """When ``run_dir``'s last launch started (``launch.json``), or its ``config.yaml``'s time; None for a
    dir that never held a run."""
    try:
        return float(json.loads((run_dir / "launch.json").read_text())["launched"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return (run_dir / "config.yaml").stat().st_mtime
    except OSError:
        return None


def latest_trial(exp_dir: Path) -> str | None:
    """The trial of ``exp_dir`` launched last, or None."""
    best: tuple[float, str] | None = None
    if not exp_dir.is_dir():
        return None
    for d in exp_dir.iterdir():
        t = launched_at(d) if d.is_dir() else None
        if t is not None and (best is None or (t, d.name) > best):
            best = (t, d.name)
    return best[1] if best else None


# ---------------------------------------------------------------- resume

def recover_state(run_dir: Path, resume: str) -> tuple[int, Path] | None:
    """``(step, dir)`` of the recover state a launch with ``resume`` continues from, or None."""
    if resume in ("none", ""):
        return None
    if resume in AUTO_RESUME:
        try:
            latest = json.loads((run_dir / "recover" / "latest.json").read_text())
        except (OSError, ValueError):
            return None
        p = run_dir / "recover" / str(latest.get("path", ""))
        return (int(latest["step"]), p) if (p / "trainer.json").is_file() else None
    p = Path(os.path.expanduser(resume))
    try:
        return int(json.loads((p / "trainer.json").read_text())["step"]), p
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError("resume", f"{resume} is not a recover state (no readable trainer.json)",
                          "use resume=auto, resume=force or a <run_dir>/recover/step_N dir") from None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def config_tree(cfg_or_path: Any) -> dict[str, Any]:
    """A config (or a saved ``config.yaml``) as the plain nested dict its YAML holds."""
    from omegaconf import OmegaConf

    if isinstance(cfg_or_path, (str, os.PathLike)):
        return OmegaConf.to_container(OmegaConf.load(str(cfg_or_path)))  # type: ignore[return-value]
    # Through YAML text, as save_config writes it, so both sides have the same types (tuples, floats).
    return OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(cfg_or_path))))


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for every leaf that differs, ignored keys left out. A key the old config lacks
    (written by an older release) counts only when the new value is not the schema's default."""
    from areal_cli.config.schema import ExperimentConfig

    a, b = _flat(old), _flat(new)
    defaults = _flat(config_tree(ExperimentConfig()))
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == k or key.startswith(k + ".") for k in IGNORED):
            continue
        va, vb = a.get(key, defaults.get(key)), b.get(key, defaults.get(key))
        if va != vb:
            out.append((key, va, vb))
    return out


def is_harmless(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in HARMLESS)


def _show(v: Any) -> str:
    text = "null" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else str(v).lower() \
        if isinstance(v, bool) else str(v)
    return text if len(text) <= 60 else text[:57] + "…"


def check_resume(cfg: ExperimentConfig, run_dir: Path, step: int) -> list[tuple[str, Any, Any]]:
    """The changes against the run dir's saved config; raises for one the checkpoint depends on
    (unless ``resume=force``). Returns every change (the caller lists them)."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return []
    changes = config_changes(config_tree(saved), config_tree(cfg))
    risky = [c for c in changes if not is_harmless(c[0])]
    if risky and cfg.resume != "force":
        diff = ", ".join(f"{k} {_show(a)} → {_show(b)}" for k, a, b in risky)
        fresh = new_trial_name(experiment_dir(cfg), claim=False)
        raise ConfigError("resume", f"{cfg.experiment_name}/{cfg.trial_name}'s checkpoint (step {step}) depends "
                          f"on settings that changed since the checkpoint: {diff}",
                          f"resume with the old values, start a new run (trial_name={fresh}), "
                          "or resume=force")
    return changes


def settle_run(cfg: ExperimentConfig, *, claim: bool = True, check: bool = True) -> RunChoice:
    """Name the run (``cfg.trial_name`` is set on return) and check its resume. ``claim``: create a new
    run's dir (not for a dry run); ``check``: refuse a resume whose overrides changed what the
    checkpoint depends on (unless ``resume=force``)."""
    resume = str(cfg.resume or "none")
    exp_dir = experiment_dir(cfg)
    choice = RunChoice(name="")
    if not cfg.trial_name:
        latest = latest_trial(exp_dir) if resume in AUTO_RESUME else None
        if latest is not None:
            cfg.trial_name, choice.picked_latest = latest, True
        else:
            made = [d for d in (exp_dir, *exp_dir.parents) if not d.exists()]
            cfg.trial_name = new_trial_name(exp_dir, claim=claim)
            choice.made = made if claim else []
            choice.no_earlier_run = resume in AUTO_RESUME
            choice.claimed = exp_dir / cfg.trial_name if claim else None
    choice.name = f"{cfg.experiment_name}/{cfg.trial_name}"
    run_dir = exp_dir / cfg.trial_name
    state = recover_state(run_dir, resume)
    if state is None:
        return choice
    choice.step, choice.checkpoint = state[0], str(state[1])
    if not check:
        return choice
    if resume in AUTO_RESUME:
        choice.changed = check_resume(cfg, run_dir, state[0])
    else:  # a recover dir named outright is the user's decision; its run's differences are listed
        saved = state[1].parent.parent / "config.yaml"
        choice.changed = config_changes(config_tree(saved), config_tree(cfg)) if saved.is_file() else []
    return choice


def resume_command(overrides: list[str], trial_name: str) -> str:
    """``areal train <overrides> trial_name=<name> resume=auto``: the user's overrides in their order,
    with their own ``trial_name``/``resume`` replaced, and the ``--config-dir`` dirs they composed with."""
    from areal_cli.plan.groups import user_config_dirs

    keep = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].strip() not in ("trial_name", "resume")]
    dirs = [a for d in user_config_dirs() for a in ("--config-dir", str(d))]
    return shlex.join(["areal", *dirs, "train", *keep, f"trial_name={trial_name}", "resume=auto"])


def after_stop_line(run_dir: str, overrides: list[str] | None, trial_name: str, recover_every: int) -> str:
    """What to type to go on after Ctrl-C or a failure: the resume command with its step, or why there is
    nothing to resume yet."""
    state = recover_state(Path(run_dir), "auto")
    if state is None:
        if not recover_every:
            return "nothing to resume from: trainer.recover_every=0 saves no recover state"
        return f"nothing to resume from yet: the first recover state is saved at step {recover_every} " \
               "(trainer.recover_every)"
    cmd = resume_command(list(overrides or []), trial_name)
    return f"to resume from step {state[0]}: {cmd}"
