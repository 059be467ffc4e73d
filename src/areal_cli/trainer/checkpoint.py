"""Checkpoints: HF exports every N steps, and recover states every M steps for ``resume=auto``.

A recover state is a directory ``<run_dir>/recover/step_<N>/``:

- ``engine/``        the engine's resumable state (model, optimizer, scheduler) via ``engine.save(dcp)``
- ``rank<R>.pt``     per-rank RNG states (python, numpy, torch, cuda): the only place they are saved and
                     restored. RNG state belongs to the process, not to one engine (a run may hold an
                     actor, a reference and a critic engine), so engines' checkpoints leave it out.
- ``trainer.json``   rank 0's loop state: step, policy version, dataloader position, rollout
                     executor counters (accepted / staleness), SFT progress, wall time so far

It is written to ``step_<N>.partial`` and renamed when every rank finished, then
``recover/latest.json`` is replaced atomically, so a run killed mid-save resumes from the previous
complete state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from areal_cli.errors import ConfigError
from areal_cli.utils.dist import barrier


def rng_state() -> dict[str, Any]:
    import torch

    st: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        st["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import torch

    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


class CheckpointManager:
    """HF exports and recover states of one run. Every method is collective over the trainer ranks."""

    def __init__(self, run_dir: str, *, rank: int, keep: int = 2, tokenizer_path: str | None = None):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.keep = max(1, int(keep))
        self.tokenizer_path = tokenizer_path
        self.recover_root = self.run_dir / "recover"
        self.hf_root = self.run_dir / "checkpoints"

    # ------------------------------------------------------------ HF export
    def export_hf(self, engine: Any, name: str) -> str:
        from areal_cli.api.io_struct import SaveLoadMeta

        path = self.hf_root / name
        engine.save(SaveLoadMeta(path=str(path), weight_format="hf", tokenizer_path=self.tokenizer_path))
        barrier()
        if self.rank == 0:
            (self.hf_root / "latest").unlink(missing_ok=True)
            os.symlink(name, self.hf_root / "latest")
            self._prune(self.hf_root, "step_")
        return str(path)

    # ------------------------------------------------------------ recover
    def save_recover(self, engine: Any, step: int, trainer_state: dict[str, Any],
                     others: dict[str, Any] | None = None) -> str:
        import torch

        from areal_cli.api.io_struct import SaveLoadMeta

        final = self.recover_root / f"step_{step:06d}"
        tmp = self.recover_root / f"step_{step:06d}.partial"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        engine.save(SaveLoadMeta(path=str(tmp / "engine"), weight_format="dcp", with_optim=True,
                                 tokenizer_path=self.tokenizer_path))
        for name, other in (others or {}).items():  # e.g. the critic
            other.save(SaveLoadMeta(path=str(tmp / name), weight_format="dcp", with_optim=True))
        torch.save(rng_state(), tmp / f"rank{self.rank}.pt")
        if self.rank == 0:
            (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
        barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest = self.recover_root / "latest.json"
            tmp_latest = self.recover_root / ".latest.json.tmp"
            tmp_latest.write_text(json.dumps({"step": step, "path": final.name}))
            os.replace(tmp_latest, latest)
            self._prune(self.recover_root, "step_")
        barrier()
        return str(final)

    def find_recover(self, resume: str) -> Path | None:
        """The recover dir to continue from, or None (``resume=none`` or nothing saved yet)."""
        if resume in ("none", "", None, False):
            return None
        if resume in ("auto", "force"):  # force: the CLI skipped its config check; the same state
            latest = self.recover_root / "latest.json"
            if not latest.exists():
                return None
            p = self.recover_root / json.loads(latest.read_text())["path"]
            return p if p.is_dir() else None
        p = Path(os.path.expanduser(resume))
        if not (p / "trainer.json").is_file():
            raise ConfigError("resume", f"{resume} is not a recover state (no trainer.json)",
                              "use resume=auto, resume=force or a <run_dir>/recover/step_N dir")
        return p

    def resume_loop(self, resume: str, engine: Any, stream: Any, stats: Any, kind: str, rank: int) -> int:
        """For a one-engine loop (SFT, reward model): restore the engine, the prompt stream's position and the
        metrics from the recover state ``resume`` names, log the start event, and return the step to go on
        from (0 on a fresh run). ``kind``: the loop's per-step metrics kind."""
        start = 0
        recover = self.find_recover(resume)
        if recover is not None:
            state = self.load_recover(engine, recover)
            start = int(state["step"])
            stream.load_state_dict(state["stream"])
            stats.truncate_after(start, kinds=(kind, "eval"))
            if rank == 0:
                print(f"[areal] resuming from step {start} (checkpoint {recover})", flush=True)
        stats.log("event", start, {"event": "start", "resumed_from": start})
        return start

    def load_recover(self, engine: Any, path: Path, others: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restore the engine and this rank's RNG; returns rank 0's trainer state (on every rank)."""
        import torch

        from areal_cli.api.io_struct import SaveLoadMeta

        engine.load(SaveLoadMeta(path=str(path / "engine"), weight_format="dcp", with_optim=True))
        for name, other in (others or {}).items():
            other.load(SaveLoadMeta(path=str(path / name), weight_format="dcp", with_optim=True))
        rng_file = path / f"rank{self.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return json.loads((path / "trainer.json").read_text())

    def _prune(self, root: Path, prefix: str) -> None:
        done = sorted(p for p in root.glob(f"{prefix}*") if p.is_dir() and not p.name.endswith(".partial")
                      and not p.is_symlink())
        for p in done[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)


def run_engine_loop(tc: Any, start: int, engine: Any, ckpt: CheckpointManager, stream: Any, stats: Any, rank: int,
                    run_steps: Any, evaluate: Any, export: Any) -> dict[str, Any]:
    """The step loop of a one-engine run (SFT, reward model): ``run_steps(first_step, n)`` in chunks that end
    at every save/recover/eval boundary of ``tc`` (the trainer config), those actions at each, then the
    final evaluation and export. Returns the run's result and closes stats and engine."""
    if start == 0:
        evaluate(0)
    step = start
    while step < tc.total_steps:
        chunk = tc.total_steps - step
        for boundary in (tc.recover_every, tc.eval_every, tc.save_every):
            if boundary:
                chunk = min(chunk, boundary - step % boundary)
        run_steps(step + 1, chunk)
        step += chunk
        engine.set_version(step)
        if step == tc.total_steps:
            break
        if tc.save_every and step % tc.save_every == 0:
            export(f"step_{step:06d}")
        if tc.recover_every and step % tc.recover_every == 0:
            ckpt.save_recover(engine, step, {"step": step, "version": step, "stream": stream.state_dict()}
                              if rank == 0 else {})
        if tc.eval_every and step % tc.eval_every == 0:
            evaluate(step)
    final = evaluate(tc.total_steps)
    out = export("final")
    stats.log("event", tc.total_steps, {"event": "end", "hf_export": out})
    stats.close()
    engine.destroy()
    return {"final_eval": final, "hf_export": out}
