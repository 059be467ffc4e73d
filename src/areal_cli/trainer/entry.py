"""Trainer-rank entry point, run under torchrun (or srun):

    python -m torch.distributed.run ... --module areal_cli.trainer.entry --config RUN_DIR/config.yaml

Reads the resolved config and ``launch.json`` (layout + model path) that ``areal train`` wrote to
the run dir, sends this rank's output to ``RUN_DIR/logs/trainer_rank<R>.log``, initialises the
process group and runs the RL, SFT or reward-model loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

LAUNCH_FILE = "launch.json"


def _redirect_output(run_dir: str, rank: int) -> None:
    """One log file per rank; the launcher reads these to name a failed rank."""
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_dir / f"trainer_rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="areal_cli.trainer.entry")
    ap.add_argument("--config", required=True, help="RUN_DIR/config.yaml written by `areal train`")
    ap.add_argument("--no-redirect", action="store_true", help="keep output on the terminal")
    args = ap.parse_args(argv)
    run_dir = str(Path(args.config).resolve().parent)  # every launcher starts ranks on RUN_DIR/config.yaml
    rank = int(os.environ.get("RANK", "0"))
    if not args.no_redirect:
        _redirect_output(run_dir, rank)
    try:
        return _run(args.config, run_dir)
    except BaseException as e:  # noqa: BLE001 - the log must show why this rank died
        if isinstance(e, SystemExit) and not e.code:
            raise
        traceback.print_exc()
        from areal_cli.errors import RANK_CRASH_PREFIX, USER_ERROR_PREFIX, ArealError

        # The launcher shows this line instead of the traceback, and stops the run on seeing it
        # (launchers/failures.py).
        if isinstance(e, ArealError):
            print(f"{USER_ERROR_PREFIX}{str(e).replace(chr(10), ' ')}", file=sys.stderr, flush=True)
        elif isinstance(e, Exception):
            last = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
            print(f"{RANK_CRASH_PREFIX}{last[0] if last else type(e).__name__}", file=sys.stderr, flush=True)
        return 1


def _run(config_path: str, run_dir: str) -> int:
    import torch

    from areal_cli.job.layout import MODEL_PATH_ENV, JobLayout
    from areal_cli.models.hub import ensure_local_model
    from areal_cli.config.io import load_config_file
    from areal_cli.utils.dist import destroy_distributed, init_distributed

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    cfg = load_config_file(config_path)
    info = json.loads((Path(run_dir) / LAUNCH_FILE).read_text())
    layout = JobLayout.from_dict(info["layout"])
    # The node's runner sets MODEL_PATH_ENV to the snapshot it fetched; a hub id left here (a rank started by
    # other means) resolves through the same per-node cache and lock.
    model_path = ensure_local_model(os.environ.get(MODEL_PATH_ENV) or info["model_path"],
                                    info.get("model_revision") or cfg.model.revision or None)
    rank, world = init_distributed()
    from areal_cli.utils import host_memory

    host_memory.fit_model(model_path)  # a small model's activations stay on the heap
    print(f"[areal] trainer rank {rank}/{world} pid {os.getpid()} run_dir {run_dir} model {model_path}",
          flush=True)
    try:
        if cfg.algo.name == "sft":
            from areal_cli.trainer.sft import run_sft

            result = run_sft(cfg, layout, run_dir, model_path, rank, world)
        elif cfg.algo.name == "rm":
            from areal_cli.trainer.rm import run_rm

            result = run_rm(cfg, layout, run_dir, model_path, rank, world)
        else:
            from areal_cli.trainer.rl import RLTrainer

            result = RLTrainer(cfg, layout, run_dir, model_path, rank, world).run()
        if rank == 0:
            print(f"[areal] finished: {json.dumps(result, default=str)}", flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
