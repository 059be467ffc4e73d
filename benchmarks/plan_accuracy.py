"""Does ``areal plan`` predict what ``areal train`` does on this machine? Predicted against measured, per config.

    python benchmarks/plan_accuracy.py                   # calibrate, then every config once
    python benchmarks/plan_accuracy.py --repeats 2 --steps 24 --hardware cpu-ci

For each configuration it runs a real ``areal train`` (RL steps only, no warm start, no evaluation) and measures:

- step time: the median of ``perf/step_s`` over the steps after the first ``--skip`` (start-up, first syncs),
  and samples/s = prompts × group / that median;
- peak resident memory of the trainer rank and of the inference server process: their ``VmHWM`` read from
  ``/proc`` every 0.2 s while they live (the kernel's high-water mark, so no spike is missed).

It then composes the same overrides, validates them and asks the planner (``planner.model.plan_config``) with the
calibrated profile (``--hardware``; ``--calibrate`` measures one first). The table shows both with the relative
error; the issue's bounds are ±25% on time and samples/s and ±20% on memory. ``--out FILE`` writes every figure
as JSON. Runs are sequential: on a 2-core host two runs at once would measure each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GIB = 1024 ** 3
TIME_BOUND, MEM_BOUND = 0.25, 0.20

M11_9 = ["model.path=builtin:tiny", "model.hidden_size=256", "model.num_hidden_layers=12",
         "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.intermediate_size=1024"]
# The RL step of each configuration, nothing else: no SFT warm start, no evaluation, no checkpoints.
COMMON = ["trainer.sft_warmup_steps=0", "trainer.eval_every=0", "trainer.recover_every=0", "trainer.save_every=0",
          "dataset.test_size=8", "stats.live=false", "engine.max_tokens_per_mb=auto"]
CONFIGS: dict[str, list[str]] = {
    "default sync": ["rollout=sync"],
    "default async": [],
    "11.9M 16 tok": [*M11_9, "rollout.gconfig.max_new_tokens=16"],
    "11.9M 64 tok": [*M11_9, "rollout.gconfig.max_new_tokens=64"],
    "group 4": ["rollout.group_size=4"],
    "group 16": ["rollout.group_size=16"],
    "train d2": ["cluster.n_gpus_per_node=3", "allocation_mode=hf:d1+d2"],
    "train t2": ["cluster.n_gpus_per_node=3", "engine=archon", "allocation_mode=hf:d1+t2"],
}

# Configs whose steps take many seconds: fewer steps keep each run near a minute; the median needs few.
MAX_STEPS = {"11.9M 16 tok": 10, "11.9M 64 tok": 8}


class PeakWatch:
    """Samples the ``VmHWM`` of every process under ``root`` until stopped; keeps each pid's last value
    (the high-water mark only grows) and which role its command line says it plays."""

    def __init__(self, root: int, interval: float = 0.2):
        self.root, self.interval = root, interval
        self.peaks: dict[int, tuple[str, int]] = {}
        self.cpu: dict[int, float] = {}  # pid -> user + system CPU seconds at its last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def role(cmdline: list[str]) -> str:
        text = " ".join(cmdline)
        if "inference.hf_server" in text:
            return "server"
        if "torch.distributed.run" in text:
            return "torchrun"
        if "areal_cli.trainer.entry" in text:
            return "trainer"
        if "multiprocessing" in text:
            return "worker"
        return "cli" if "areal_cli.cli.main" in text else "other"

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    with open(f"/proc/{p.pid}/status") as f:
                        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
                    role = self.peaks.get(p.pid, (None,))[0] or self.role(p.cmdline())
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system
                except (OSError, StopIteration, psutil.Error):
                    continue
                self.peaks[p.pid] = (role, max(hwm, self.peaks.get(p.pid, ("", 0))[1]))
            self._stop.wait(self.interval)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds per role over the run (what each kind of process asked of the cores)."""
        out: dict[str, float] = {}
        for pid, (role, _) in self.peaks.items():
            out[role] = out.get(role, 0.0) + self.cpu.get(pid, 0.0)
        return out

    def peak_gb(self, role: str) -> float | None:
        got = [v for r, v in self.peaks.values() if r == role]
        return max(got) / GIB if got else None


def measure(name: str, overrides: list[str], steps: int, skip: int, root: str) -> dict:
    trial = name.replace(" ", "_").replace(".", "")
    argv = [sys.executable, "-m", "areal_cli.cli.main", "train", *overrides, f"cluster.fileroot={root}",
            "experiment_name=planacc", f"trial_name={trial}", f"trainer.total_steps={steps}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with PeakWatch(proc.pid) as watch:
        out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{name}: areal train failed (exit {proc.returncode}):\n{out[-3000:]}")
    run_dir = Path(root) / "runs" / "planacc" / trial
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    kept = [r for r in train if r["step"] > skip] or train
    step_s = statistics.median(r["perf/step_s"] for r in kept)

    def med(key: str) -> float | None:
        vals = [r[key] for r in kept if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    return {"step_s": step_s, "gen_wait_s": med("perf/gen_wait_s"), "train_s": med("perf/train_s"),
            "sync_s": med("perf/weight_sync_s"), "samples_per_s": med("perf/samples_per_s"),
            "trainer_gb": watch.peak_gb("trainer"), "server_gb": watch.peak_gb("server"),
            "n_steps": len(kept), "wall_s": time.perf_counter() - t0, "cpu_s": watch.cpu_s()}


def predict(overrides: list[str], hardware: str) -> dict:
    from areal_cli.cli.common import compose_and_validate
    from areal_cli.allocation.hardware import get_profile
    from areal_cli.planner.model import plan_config

    from areal_cli.planner.lengths import dataset_prompt_lengths

    cfg, plan = compose_and_validate([*overrides, f"cluster.hardware={hardware}"])
    lengths = dataset_prompt_lengths(cfg)  # what `areal plan` reads too: the prompts as the trainer renders them
    kw = {} if lengths is None else {"prompt_tokens": lengths.mean, "max_prompt_tokens": lengths.max}
    got = plan_config(cfg, plan, get_profile(hardware), **kw).to_dict()
    # A measured peak is a real step's, at the real lengths: compare it with the typical figure (at the mean
    # lengths), not with the bound at the caps.
    mem = {c["kind"]: c["memory"]["expected_gb"] for c in got["components"]}
    return {"step_s": got["step"]["step_s"], "gen_s": got["step"]["gen_s"], "train_s": got["step"]["train_s"],
            "sync_s": got["step"]["sync_s"], "samples_per_s": got["samples_per_s"],
            "trainer_gb": mem.get("train"), "server_gb": mem.get("inference")}


def rel(pred: float | None, meas: float | None) -> float | None:
    if pred is None or not meas:
        return None
    return (pred - meas) / meas


def report(rows: list[dict]) -> bool:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="areal plan: predicted vs measured on this machine (error = predicted/measured - 1)")
    for col in ("config", "step s (pred / meas)", "err", "train s (pred / meas)", "err", "samples/s (pred / meas)",
                "err", "trainer GiB (pred / meas)", "err", "server GiB (pred / meas)", "err"):
        t.add_column(col, justify="left" if col == "config" else "right")
    ok = True
    for r in rows:
        p, m = r["predicted"], r["measured"]
        cells = [r["config"]]
        for key, bound in (("step_s", TIME_BOUND), ("train_s", TIME_BOUND), ("samples_per_s", TIME_BOUND),
                           ("trainer_gb", MEM_BOUND), ("server_gb", MEM_BOUND)):
            e = rel(p.get(key), m.get(key))
            inside = e is not None and abs(e) <= bound
            ok &= inside
            r.setdefault("errors", {})[key] = e
            fmt = "{:.3f}" if key in ("step_s", "train_s") else "{:.2f}"
            cells.append(f"{fmt.format(p[key]) if p.get(key) is not None else '-'} / "
                         f"{fmt.format(m[key]) if m.get(key) is not None else '-'}")
            cells.append("-" if e is None else f"[{'green' if inside else 'red'}]{e:+.0%}[/]")
        t.add_row(*cells)
    Console().print(t)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    ap.add_argument("--steps", type=int, default=20, help="RL steps per run")
    ap.add_argument("--skip", type=int, default=4, help="steps left out of the median (start-up)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per config (the median of each figure)")
    ap.add_argument("--hardware", default="cpu-calibrated", help="profile name to predict with")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine first, save as --hardware")
    ap.add_argument("--predict-only", action="store_true", help="print predictions, run nothing")
    ap.add_argument("--out", help="write all figures as JSON here (after every config)")
    ap.add_argument("--reuse", help="a previous --out file: its measurements are kept (only the predictions "
                                    "are recomputed) and only configs it lacks are run")
    args = ap.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if args.calibrate:
        from areal_cli.planner.calibrate import calibrate
        from areal_cli.allocation.hardware import save_profile

        print("calibrated profile saved to", save_profile(calibrate(name=args.hardware)))
    rows = []
    old = {r["config"]: r["measured"] for r in json.loads(Path(args.reuse).read_text())} if args.reuse else {}
    with tempfile.TemporaryDirectory(prefix="planacc_") as root:
        for name in names:
            overrides = [*COMMON, *CONFIGS[name]]
            pred = predict(overrides, args.hardware)
            meas: dict = dict(old.get(name) or {})
            if not args.predict_only and not meas:
                steps = min(args.steps, MAX_STEPS.get(name, args.steps))
                skip = min(args.skip, steps // 3)
                runs = [measure(name, overrides + [f"seed={i}"], steps, skip, f"{root}/{i}")
                        for i in range(args.repeats)]
                meas = {k: statistics.median(r[k] for r in runs if r[k] is not None)
                        for k in runs[0] if k != "cpu_s" and any(r[k] is not None for r in runs)}
                meas["runs"] = runs
            rows.append({"config": name, "overrides": overrides, "predicted": pred, "measured": meas})
            print(f"{name}: predicted {pred}; measured {({k: v for k, v in meas.items() if k != 'runs'})}",
                  flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    ok = report(rows) if not args.predict_only else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
