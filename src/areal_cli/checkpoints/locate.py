"""Which checkpoint a ``RUN`` or ``CKPT`` argument means (torch-free: the CLI imports it).

A run dir (``<fileroot>/runs/<experiment>/<trial>``, written by ``areal train``) holds:

- ``checkpoints/step_<N>/`` (every ``trainer.save_every`` steps) and ``checkpoints/final/`` (at the end):
  HF dirs; under LoRA the merged model, with the adapter alone in ``lora_adapter/``;
- ``recover/step_<N>/`` (every ``trainer.recover_every`` steps): the engine's resumable state, which
  ``export.py`` turns into an HF dir where the engine's format allows it;
- ``config.yaml`` and ``launch.json``: the run's resolved config and the model dir it started from.

The argument is a path (a run dir, one of its checkpoints or recover states, or any HF model dir) or a
run's name, ``experiment/trial`` or ``experiment`` (its newest trial), under ``cluster.fileroot``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from areal_cli.errors import ArealError
from areal_cli.weight_sync.adapter_files import ADAPTER_SUBDIR
from areal_cli.runs.rundir import LAUNCH_FILE, RunNotFound, is_run_dir, read_config, resolve_run



class CheckpointError(ArealError):
    """A run or checkpoint argument names nothing usable; the message lists what exists."""


@dataclass
class Source:
    """One checkpoint: ``kind`` ``hf`` (an HF dir) or ``recover`` (a recover state's dir)."""

    kind: str
    path: Path
    run_dir: Path | None = None
    step: int | None = None
    name: str = ""
    origin: Path | None = None  # where a pinned copy's files were linked from (``pinned``)

    @property
    def shown(self) -> Path:
        """The checkpoint's own path, for messages and results (not a pinned copy's)."""
        return self.origin or self.path

    @property
    def adapter_dir(self) -> Path | None:
        """The peft adapter beside an HF export of a LoRA run, or the dir itself when it is an adapter."""
        if self.kind != "hf":
            return None
        if (self.path / "adapter_config.json").is_file():
            return self.path
        d = self.path / ADAPTER_SUBDIR
        return d if (d / "adapter_config.json").is_file() else None

    def describe(self) -> str:
        where = f"{self.run_dir.name} " if self.run_dir is not None else ""
        step = f" (step {self.step})" if self.step is not None else ""
        what = "recover state" if self.kind == "recover" else "checkpoint"
        return f"{where}{what} {self.name or self.shown.name}{step}: {self.shown}"


def is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() or (p / "adapter_config.json").is_file()


def is_recover_dir(p: Path) -> bool:
    return (p / "trainer.json").is_file()


def _step_of(name: str) -> int | None:
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if name.startswith("step_") and tail.isdigit() else None


def total_steps(run_dir: Path) -> int | None:
    v = (read_config(run_dir).get("trainer") or {}).get("total_steps")
    return int(v) if isinstance(v, int) else None


def hf_checkpoints(run_dir: Path) -> list[Source]:
    """The run's complete HF exports, oldest first (``final`` last: the step the run ended at)."""
    root = run_dir / "checkpoints"
    out = []
    for p in sorted(root.glob("step_*")) if root.is_dir() else []:
        if p.is_dir() and not p.is_symlink() and is_hf_dir(p) and _step_of(p.name) is not None:
            out.append(Source("hf", p, run_dir, _step_of(p.name), p.name))
    final = root / "final"
    if final.is_dir() and is_hf_dir(final):
        out.append(Source("hf", final, run_dir, total_steps(run_dir), "final"))
    return out


def recover_states(run_dir: Path) -> list[Source]:
    """Complete recover states (``.partial`` ones were cut short), oldest first."""
    root = run_dir / "recover"
    out = []
    for p in sorted(root.glob("step_*")) if root.is_dir() else []:
        if p.is_dir() and not p.name.endswith(".partial") and is_recover_dir(p):
            out.append(Source("recover", p, run_dir, _step_of(p.name), f"recover/{p.name}"))
    return out


def inventory(run_dir: Path) -> str:
    """What the run holds, for error messages: ``HF checkpoints: step 2, 4, final (6); recover: 4``."""
    hf = ", ".join("final" + (f" (step {s.step})" if s.step is not None else "") if s.name == "final"
                   else str(s.step) for s in hf_checkpoints(run_dir)) or "none"
    rec = ", ".join(str(s.step) for s in recover_states(run_dir)) or "none"
    return f"HF checkpoints at steps: {hf}; recover states at steps: {rec}"


def _enclosing_run(p: Path) -> Path | None:
    for parent in list(p.parents)[:3]:
        if is_run_dir(parent):
            return parent
    return None


def find_run(name: str, fileroot: str | None = None) -> Path:
    """``experiment/trial`` or ``experiment`` (its most recently active trial) under ``<fileroot>/runs``:
    the same lookup as ``areal status`` (runs/rundir.py), its miss reported as a checkpoint error."""
    try:
        return resolve_run(name, fileroot)
    except RunNotFound as e:
        raise CheckpointError(str(e)) from None


def resolve(target: str, *, step: int | None = None, fileroot: str | None = None) -> Source:
    """The checkpoint ``target`` means: its latest HF export (or the one at ``step``), else its latest
    recover state; a checkpoint path is taken as it is."""
    p = Path(os.path.expanduser(target))
    if p.exists():
        p = p.resolve()
        if not p.is_dir():
            raise CheckpointError(f"{target} is a file — fix: pass a run dir or a checkpoint dir "
                                  "(one with config.json)")
        if is_run_dir(p):
            return _pick(p, step)
        if is_hf_dir(p) or is_recover_dir(p):
            if step is not None:
                raise CheckpointError(f"--step {step}: {target} is one checkpoint already — fix: drop --step, "
                                      "or pass the run dir")
            kind = "hf" if is_hf_dir(p) else "recover"
            run = _enclosing_run(p)
            name = f"recover/{p.name}" if kind == "recover" else p.name
            return Source(kind, p, run, (total_steps(run) if run and p.name == "final" else _step_of(p.name)), name)
        raise CheckpointError(f"{target} is neither a run dir (config.yaml) nor a checkpoint (config.json, "
                              "adapter_config.json or trainer.json) — fix: pass <run_dir>, "
                              "<run_dir>/checkpoints/<name> or an HF model dir")
    return _pick(find_run(target, fileroot), step)


def _pick(run_dir: Path, step: int | None) -> Source:
    hf, rec = hf_checkpoints(run_dir), recover_states(run_dir)
    if step is not None:
        for s in reversed(hf):
            if s.step == step:
                return s
        for s in reversed(rec):
            if s.step == step:
                return s
        raise CheckpointError(f"run {run_dir} has no checkpoint at step {step} ({inventory(run_dir)}) — fix: "
                              "pick one of those steps, or drop --step for the latest")
    if hf:
        return hf[-1]
    if rec:
        return rec[-1]
    sft = run_dir / "sft_warmup" / "hf"
    also = f"; its SFT warm start is an HF dir: {sft}" if is_hf_dir(sft) else ""
    raise CheckpointError(f"run {run_dir} has no checkpoint yet (no HF export in checkpoints/, no recover "
                          f"state in recover/){also} — fix: let it reach trainer.recover_every or its end "
                          "(HF export), or train with trainer.save_every=N for an HF export every N steps")


def launch_info(run_dir: Path | None) -> dict:
    if run_dir is None or not (run_dir / LAUNCH_FILE).is_file():
        return {}
    try:
        return json.loads((run_dir / LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return {}


def policy_base(run_dir: Path) -> Path | None:
    """The model the run's RL phase started from: its SFT warm start when it had one, else the model dir it
    was launched with (a LoRA adapter applies to this one)."""
    sft = run_dir / "sft_warmup" / "hf"
    if is_hf_dir(sft):
        return sft
    path = launch_info(run_dir).get("model_path")
    return Path(path) if path and Path(path).is_dir() else None


def engine_name(run_dir: Path | None) -> str | None:
    if run_dir is None:
        return None
    return (read_config(run_dir).get("engine") or {}).get("name")


PIN_PREFIX = ".pinned-"


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` holding hard links to ``src``'s files (symlinks as symlinks): the same bytes, no copy."""
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            s, d = Path(root) / name, dst / rel / name
            if s.is_symlink():
                os.symlink(os.readlink(s), d)
            else:
                os.link(s, d)


@contextmanager
def pinned(target: str, *, step: int | None = None, fileroot: str | None = None) -> Iterator[Source]:
    """The checkpoint ``target`` means, held still while it is read.

    A running run prunes its older HF exports (``trainer.keep_checkpoints``) and recover states, so one
    picked a moment ago can vanish under a reader that takes minutes (a server loading it, a DCP read). A
    checkpoint inside a run dir is therefore hard-linked into a private dir of that run first: no bytes are
    copied, and a pruned original leaves the linked files whole. If the run pruned it while it was being
    linked, the newest one is taken again. A filesystem without hard links reads the checkpoint in place.
    """
    for _ in range(3):
        src = resolve(target, step=step, fileroot=fileroot)
        if src.run_dir is None:
            yield src
            return
        pin = Path(tempfile.mkdtemp(prefix=PIN_PREFIX, dir=src.run_dir))
        try:
            try:
                _link_tree(src.path, pin / src.path.name)
            except FileNotFoundError:
                continue  # pruned mid-link: resolve again
            except OSError:  # no hard links here (or across a mount): read in place
                yield src
                return
            yield replace(src, path=pin / src.path.name, origin=src.path)
            return
        finally:
            shutil.rmtree(pin, ignore_errors=True)
    raise CheckpointError(f"{target}: its newest checkpoint was pruned three times while being read (the "
                          "run saves faster than it can be linked) — fix: pass --step N of an older one it "
                          "keeps, or raise trainer.keep_checkpoints")
