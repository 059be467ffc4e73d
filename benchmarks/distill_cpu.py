"""docs/rewards.md's CPU result "a teacher distils into a smaller student", end to end, with its plot.

Four phases, each an ``areal train`` of the embedded default under ``--fileroot`` (a phase whose run already
finished is reused, so an interrupted study resumes):

1. the teacher: the embedded default model (128 x 2), its SFT warm start and ``--teacher-steps`` RL steps;
2. the student's weak warm start: a 96 x 2 model, ``--warm-sft-steps`` SFT steps, exported once
   (``sft_warmup/hf``; one RL step so the run completes);
3. per seed, interleaved (started together): pure on-policy distillation from the teacher
   (``algo.distill.teacher_path``) and GRPO, both from that export, ``--steps`` steps, evaluated every
   ``--eval-every`` (greedy pass@1 on the seed's held-out items), the default recipe otherwise;
4. the table (held-out accuracy per evaluation, gain, seed means) and ``distill_vs_grpo.png``.

    python benchmarks/distill_cpu.py --fileroot /tmp/distill                 # the documented study
    python benchmarks/distill_cpu.py --fileroot /tmp/distill --report-only   # table and plot of finished runs
    python benchmarks/distill_cpu.py --fileroot /tmp/distill --variant mix:algo.distill.task_reward_weight=1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

STUDENT = ("model.hidden_size=96", "model.num_hidden_layers=2", "model.num_attention_heads=4",
           "model.num_key_value_heads=2", "model.intermediate_size=384")


def _cmd(root: str, name: str, trial: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={root}",
            f"experiment_name={name}", f"trial_name={trial}", "stats.live=false", *overrides]


def _done(root: str, name: str, trial: str) -> bool:
    status = Path(root) / "runs" / name / trial / "status.json"
    return status.is_file() and json.loads(status.read_text()).get("state") == "done"


def run_all(root: str, jobs: list[tuple[str, str, list[str]]]) -> None:
    """Start every unfinished run at once (interleaved on the machine's cores), wait for all."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    procs = []
    for name, trial, overrides in jobs:
        if _done(root, name, trial):
            print(f"[distill] {name}/{trial}: done before, reused", flush=True)
            continue
        print(f"[distill] {name}/{trial}: started", flush=True)
        log = open(Path(root) / f"{name}_{trial}.log", "w")
        procs.append((trial, subprocess.Popen(_cmd(root, name, trial, overrides), stdout=log,
                                              stderr=subprocess.STDOUT, env=env), log))
    for trial, p, log in procs:
        if p.wait() != 0:
            raise SystemExit(f"[distill] {trial} failed: see {log.name}")
        log.close()


def evals(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["eval/pass@1"] for r in recs if r.get("kind") == "eval" and r.get("phase") == "rl"}


def report(root: str, seeds: list[int], systems: list[str]) -> None:
    import statistics

    curves = {s: {seed: evals(Path(root) / "runs" / "student96" / f"{s}_s{seed}") for seed in seeds}
              for s in systems}
    steps = sorted({st for c in curves.values() for e in c.values() for st in e})
    print(f"{'run':16s} " + " ".join(f"{'@' + str(st):>6s}" for st in steps) + f" {'gain':>6s} {'mean':>6s}")
    for s in systems:
        for seed in seeds:
            e = curves[s][seed]
            gain = 100 * (e[max(e)] - e[0])
            mean = 100 * statistics.mean(v for st, v in e.items() if st > 0)
            print(f"{s + ' s' + str(seed):16s} " + " ".join(f"{100 * e[st]:6.1f}" if st in e else f"{'-':>6s}"
                                                          for st in steps) + f" {gain:+6.1f} {mean:6.1f}")
        means = [statistics.mean(curves[s][seed][st] for seed in seeds) * 100 for st in steps]
        print(f"{s + ' mean':16s} " + " ".join(f"{m:6.1f}" for m in means))
    plot(root, curves, seeds, steps)


def plot(root: str, curves: dict, seeds: list[int], steps: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (system, by_seed), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for seed in seeds:
            e = by_seed[seed]
            ax.plot(sorted(e), [100 * e[st] for st in sorted(e)], color=color, alpha=0.3, lw=1)
        mean = [100 * sum(by_seed[seed][st] for seed in seeds) / len(seeds) for st in steps]
        ax.plot(steps, mean, color=color, lw=2.2, marker="o", label=f"{system} (mean of {len(seeds)} seeds)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out pass@1 (%)")
    ax.set_title("96x2 student, weak warm start: distilled from a 128x2 teacher vs GRPO", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(root) / "distill_vs_grpo.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"[distill] plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fileroot", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--teacher-steps", type=int, default=120)
    ap.add_argument("--warm-sft-steps", type=int, default=400)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDE[,OVERRIDE...]",
                    help="one more distillation system with these overrides, e.g. mix:algo.distill.task_reward_weight=1")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    root = os.path.abspath(args.fileroot)
    os.makedirs(root, exist_ok=True)
    variants = [(v.partition(":")[0], [o for o in v.partition(":")[2].split(",") if o]) for v in args.variant]
    systems = ["distill", "grpo", *(n for n, _ in variants)]
    if not args.report_only:
        run_all(root, [("teacher", "t1", [f"trainer.total_steps={args.teacher_steps}", "trainer.eval_every=0"]),
                       ("student96", "ws", [*STUDENT, f"trainer.sft_warmup_steps={args.warm_sft_steps}",
                                            "trainer.total_steps=1"])])
        teacher = f"{root}/runs/teacher/t1/checkpoints/final"
        warm = f"{root}/runs/student96/ws/sft_warmup/hf"
        base = [*STUDENT, "trainer.sft_warmup_steps=0", f"model.path={warm}", f"trainer.total_steps={args.steps}",
                f"trainer.eval_every={args.eval_every}"]
        extra = {"distill": [f"algo.distill.teacher_path={teacher}"], "grpo": [],
                 **{n: [f"algo.distill.teacher_path={teacher}", *o] for n, o in variants}}
        run_all(root, [("student96", f"{s}_s{seed}", [*base, f"seed={seed}", *extra[s]])
                       for seed in args.seeds for s in systems])
    report(root, args.seeds, systems)


if __name__ == "__main__":
    main()
