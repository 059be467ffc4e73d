"""Does ``algo=ppo`` learn on the embedded task? ``areal train algo=ppo seed=S`` for a few seeds, each in its own
empty fileroot, and the held-out accuracy of its SFT warm start, after RL, and the gain (docs/algorithms.md,
"PPO on the embedded task", records the figures and the commands).

    python benchmarks/ppo_learning.py                          # seeds 1 2 3, the full embedded default recipe
    python benchmarks/ppo_learning.py --short                  # the documented shorter recipe (fewer RL steps)
    python benchmarks/ppo_learning.py --seeds 1 --json out.json -- algo.critic_lr=1e-3   # extra overrides

Runs one seed at a time (a run uses both cores of a small machine). Prints one row per seed and the mean gain;
exits 1 when a seed's run fails. Gains are never asserted here: they are measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The embedded default with fewer RL steps (same SFT warm start, same batch): what fits 3 seeds on a loaded
# 2-core machine. docs/algorithms.md says which recipe each recorded figure used.
SHORT = ("trainer.total_steps=60", "trainer.eval_every=30")


def run_seed(seed: int, overrides: list[str], root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "areal_cli.cli.main", "train", "algo=ppo", f"seed={seed}",
           f"cluster.fileroot={root}", "stats.live=false", *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if res.returncode != 0:
        sys.stderr.write((res.stdout + res.stderr)[-3000:])
        return {"seed": seed, "ok": False, "wall_s": wall, "command": " ".join(cmd[2:])}
    summary = json.loads(next(root.glob("runs/*/*/summary.json")).read_text())
    return {"seed": seed, "ok": True, "wall_s": round(wall, 1), "command": " ".join(cmd[2:]),
            "warm_start": summary.get("accuracy_warm_start", summary.get("accuracy_before")),
            "final": summary.get("accuracy_after"), "gain": summary.get("rl_gain"),
            "rl_steps": summary.get("steps")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--short", action="store_true", help="fewer RL steps: " + " ".join(SHORT))
    ap.add_argument("--root", default=None, help="where the runs go (default: a new temporary directory)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("overrides", nargs="*", help="more `areal train` overrides (after --)")
    args = ap.parse_args(argv)
    overrides = [*(SHORT if args.short else ()), *args.overrides]
    root = Path(args.root or tempfile.mkdtemp(prefix="areal_bench_ppo_"))
    rows = []
    for seed in args.seeds:
        row = run_seed(seed, overrides, root / f"seed{seed}")
        rows.append(row)
        if row["ok"]:
            print(f"seed {seed}: warm start {row['warm_start']:.1%} -> after {row['rl_steps']} PPO steps "
                  f"{row['final']:.1%} ({row['gain'] * 100:+.1f} pts) in {row['wall_s'] / 60:.1f} min", flush=True)
        else:
            print(f"seed {seed}: run failed (see above)", flush=True)
    done = [r for r in rows if r["ok"]]
    if done:
        mean = sum(r["gain"] for r in done) / len(done)
        print(f"mean gain over {len(done)} seeds: {mean * 100:+.1f} pts; "
              f"min {min(r['gain'] for r in done) * 100:+.1f} pts")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
