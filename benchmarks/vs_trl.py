"""areal train (async) vs areal train (sync) vs TRL's GRPOTrainer, on this machine, in one run.

All three start from the same warm-started tiny model (the embedded default's SFT warm start,
made first by ``areal train trainer.total_steps=0``) and train GRPO on the built-in arithmetic task
with the same prompts per step, group size, max new tokens, sampling (T=1, no top-p/top-k, stop at
EOS), learning rate, KL coefficient (0) and number of optimiser steps (one per generated batch).

Every system saves an HF checkpoint every ``--ckpt-every`` steps (its clock is paused while it
saves). After the runs, one evaluator scores every checkpoint on the same held-out items (greedy,
batched HF ``generate``, the same reward), so accuracy is measured identically for all three.

Printed per system:
- samples/s: generated samples trained on per second of the RL phase (prompts x group x steps /
  wall time from the start of the first step to the end of the last, start-up excluded);
- tokens/sample: mean completion length. The systems sample from the same model with the same
  settings, so these should agree; the benchmark says so when they do not (a samples/s ratio is
  only meaningful at equal tokens per sample);
- held-out accuracy of the warm start and of each checkpoint, and the time to reach ``--target``;
- ratios: areal async / TRL and areal async / areal sync samples/s.

Rounds: the three runs are repeated once per seed of ``--seeds`` (default 1 2 3), ``--rounds`` times over
(``--rounds 2``: seeds 1 2 3 1 2 3), interleaved (async, sync, TRL, async, ...), so a drift in the machine's
speed affects all three alike. A round's seed is areal's ``seed`` (sampling and prompt order; the data stay
``dataset.seed``'s) and TRL's ``seed``. Every round's checkpoints are evaluated; printed per system: held-out
accuracy at each checkpoint as mean [min-max] over the rounds, and time to target as the median over seeds and
rounds with the worst round (a round that never reached it counts as missed, and the median is "missed" when
half or more missed); ratios per round and their median and worst.

Threads: TRL runs in one process with all cores (``torch.set_num_threads(os.cpu_count())``);
areal runs its server, its trainer and its rollout worker as one process each, torch at one thread,
except the trainer's RL steps, which take the cores the servers leave idle (the default layout:
docs/train.md, "Threads of the train step"; measured: benchmarks/results/train_threads.md).

Lengths: 120 steps on the tiny row and 60 on the 11.9M one, 400 held-out items: at 40 and 30 steps most
seeds of every system stopped short of the target (warm start + 10 points), so no median time to target
existed (benchmarks/results/vs_trl.md, "Staleness 1 against 2").

    python benchmarks/vs_trl.py                      # the default: seeds 1 2 3, 120 steps, 8 prompts x 8, 16 tokens
    python benchmarks/vs_trl.py --seeds 1 --big-rounds 0 --steps 10 --warm DIR   # a quick look
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


def areal_train(fileroot: str, name: str, overrides: list[str]) -> Path:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={fileroot}",
           "experiment_name=bench", f"trial_name={name}", "stats.live=false", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"areal train ({name}) failed:\n{(res.stdout + res.stderr)[-4000:]}")
    return Path(fileroot) / "runs" / "bench" / name


def areal_figures(run_dir: Path, samples_per_step: int) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    # RL phase: from the start of step 1 (its end minus its duration) to the end of the last step,
    # less the checkpoint exports in between (the trainer logs their duration), as TRL's clock is.
    t0 = train[0]["time"] - train[0]["perf/step_s"]
    saves = [(r["time"], r["seconds"]) for r in recs if r["kind"] == "event" and r.get("event") == "hf_export"]

    def clock(t: float) -> float:
        return t - t0 - sum(s for ts, s in saves if ts <= t)

    ckpts = {r["step"]: (clock(r["time"]), str(run_dir / "checkpoints" / f"step_{r['step']:06d}"))
             for r in train if (run_dir / "checkpoints" / f"step_{r['step']:06d}").is_dir()}
    ckpts[train[-1]["step"]] = (clock(train[-1]["time"]), str(run_dir / "checkpoints" / "final"))
    wall = clock(train[-1]["time"])
    # Steady state: from the end of step 2 to the end of the last, so the pipeline fill (async's first
    # batch has nothing to overlap with) and the warm-up step are left out; a long run is made of these.
    first = train[min(1, len(train) - 1)]
    span = clock(train[-1]["time"]) - clock(first["time"])
    steady = samples_per_step * (train[-1]["step"] - first["step"]) / span if span > 0 else float("nan")
    return {"samples_per_s": samples_per_step * len(train) / wall, "rl_wall_s": wall, "steady_samples_per_s": steady,
            "tokens_per_sample": sum(r["gen/mean_len"] for r in train) / len(train),
            "train_s_per_step": sum(r["perf/train_s"] for r in train) / len(train),
            "checkpoints": dict(sorted(ckpts.items()))}


def trl_run(model_dir: str, args: argparse.Namespace, train_items: list[dict], out_root: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_cli.rewards import get_reward_fn

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    reward = get_reward_fn("numeric")

    def reward_fn(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward("", t, a)) for t, a in zip(texts, answer)]

    ds = Dataset.from_list([{"prompt": it["messages"], "answer": it["answer"]}
                            for it in train_items[: args.batch * args.steps]])
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl_bench_"), use_cpu=True, num_generations=args.group,
                     per_device_train_batch_size=args.batch * args.group, max_completion_length=args.max_new_tokens,
                     learning_rate=args.lr, lr_scheduler_type="constant", max_steps=args.steps, beta=0.0,
                     temperature=1.0, top_p=1.0, top_k=0, logging_steps=1, report_to="none", save_strategy="no",
                     seed=getattr(args, "trl_seed", 1), disable_tqdm=True, num_iterations=1,
                     gradient_accumulation_steps=1, dataloader_num_workers=0, bf16=args.bf16, max_grad_norm=1.0, weight_decay=0.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    clock = {"t0": None, "paused": 0.0, "ckpts": {}}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, s, c, **kw):
            if clock["t0"] is None:
                clock["t0"] = time.time()

        def on_step_end(self, a, s, c, **kw):
            step = s.global_step
            if step % args.ckpt_every == 0 or step == args.steps:
                t = time.time()
                path = os.path.join(out_root, f"step_{step:06d}")
                model.save_pretrained(path)
                tok.save_pretrained(path)
                clock["ckpts"][step] = (t - clock["t0"] - clock["paused"], path)
                clock["paused"] += time.time() - t

    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    wall = clock["ckpts"][args.steps][0]
    lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"samples_per_s": args.batch * args.group * args.steps / wall, "rl_wall_s": wall,
            "tokens_per_sample": sum(lens) / max(1, len(lens)), "train_s_per_step": float("nan"),
            "checkpoints": clock["ckpts"]}


def evaluate_dirs(dirs: list[str], items: list[dict], max_new_tokens: int) -> dict[str, float]:
    """Greedy pass@1 of each HF dir on ``items``: batched, left-padded HF ``generate``, numeric reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.rewards import get_reward_fn

    reward = get_reward_fn("numeric")
    tok = AutoTokenizer.from_pretrained(dirs[0])
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False) for it in items]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = {}
    for d in dirs:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out[d] = sum(float(reward("", t, it["answer"])) > 0.5 for t, it in zip(texts, items)) / len(items)
    return out


def compare(root: str, tag: str, model_args: list[str], model_dir: str, args: argparse.Namespace,
            steps: int, ckpt_every: int, train_items: list[dict]) -> dict:
    """The three systems on one model; returns their rows."""
    precision = ["engine.dtype=bfloat16"] if args.bf16 else []
    common = [*model_args, *precision, *_task(args), *args.areal_args, f"algo.batch_size={args.batch}",
              f"rollout.group_size={args.group}", f"rollout.gconfig.max_new_tokens={args.max_new_tokens}",
              f"algo.optim.lr={args.lr}", "algo.optim.lr_scheduler=constant", "algo.optim.warmup_steps=0", "algo.kl_coef=0",
              f"trainer.total_steps={steps}", "trainer.eval_every=0", "dataset.eval_size=8",
              "trainer.sft_warmup_steps=0", "trainer.recover_every=0", f"trainer.save_every={ckpt_every}",
              "trainer.keep_checkpoints=1000"]
    spp = args.batch * args.group
    rows = {}
    # async runs as shipped (the rollout group's staleness bound); sync sets k=0
    runs = [(ASYNC, None, []), (SYNC, 0, [])]
    for i, v in enumerate(args.variant):
        name, _, overrides = v.partition(":")
        runs.insert(1 + i, (f"areal async {name}", None, [o for o in overrides.split(",") if o]))
    for i, (name, k, extra) in enumerate(runs):
        print(f"[bench] {tag}: {name}", flush=True)
        bound = [] if k is None else [f"rollout.max_head_offpolicyness={k}"]
        run = areal_train(root, f"{tag}_" + ("async" if k is None else f"k{k}") + (f"_v{i}" if extra else ""),
                          [*common, *bound, *extra])
        rows[name] = areal_figures(run, spp)
    print(f"[bench] {tag}: TRL GRPOTrainer", flush=True)
    targs = argparse.Namespace(**{**vars(args), "steps": steps, "ckpt_every": ckpt_every})
    rows[TRL] = trl_run(model_dir, targs, train_items, os.path.join(root, f"{tag}_trl"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=400)
    ap.add_argument("--target", type=float, default=None,
                    help="held-out accuracy to reach (default: warm start + 10 points)")
    ap.add_argument("--warm", default=None, help="warm-start HF dir (default: run the embedded SFT warm start)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                    help="one round per seed (areal's run seed over fixed data, TRL's seed), for both rows")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times over the seeds for the warm-started tiny row (0: skip the row)")
    ap.add_argument("--big-rounds", type=int, default=1,
                    help="times over the seeds for the realistic row on the ~11.9M-param model (0: skip it)")
    ap.add_argument("--big-steps", type=int, default=60, help="RL steps per run of the realistic row")
    ap.add_argument("--big-new-tokens", type=int, default=64)
    ap.add_argument("--big-ckpt-every", type=int, default=5)
    ap.add_argument("--big-warm", default=None, help="warm-started HF dir of the big model (default: make one)")
    ap.add_argument("--big-warm-steps", type=int, default=300, help="SFT steps of the big model's warm start")
    ap.add_argument("--big-sft-lr", type=float, default=5e-4,
                    help="SFT learning rate of the big model's warm start (the tiny model's 2e-3 is too high for it)")
    ap.add_argument("--big-lr", type=float, default=5e-5,
                    help="RL learning rate of the realistic row (both systems; 1e-4 is already too large for on-policy "
                         "GRPO on this model: benchmarks/results/vs_trl.md)")
    ap.add_argument("--big-target", type=float, default=None,
                    help="held-out accuracy the realistic row must reach (default: its warm start + 10 points)")
    ap.add_argument("--fileroot", default=None)
    ap.add_argument("--task", default="arith",
                    help="the built-in task of both rows (data/builtin.py), e.g. word_steps: multi-step problems kept "
                         "out of tuning (give it more --max-new-tokens / --big-new-tokens: its answers are longer)")
    ap.add_argument("--bf16", action="store_true",
                    help="train in bf16 autocast over fp32 weights on both sides (areal engine.dtype=bfloat16, "
                         "TRL bf16=True); generation stays fp32 in areal's server")
    ap.add_argument("--areal-args", nargs="*", default=[],
                    help="extra overrides for both areal runs, e.g. algo.loss_agg=token-mean")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDE[,OVERRIDE...]",
                    help="one more areal async row (the shipped defaults) with these overrides, e.g. "
                         "'(plain PPO):algo.use_decoupled_loss=false'")
    args = ap.parse_args()
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"

    # The TRL baseline moves with TRL's version (its samples/s changed by 1.2x between runs): say which ran.
    print(f"[bench] versions: trl {ver('trl')}, transformers {ver('transformers')}, torch {ver('torch')}",
          flush=True)
    root = args.fileroot or tempfile.mkdtemp(prefix="areal_bench_")
    warm = args.warm
    if warm is None:  # the tiny row's start, and the tokenizer both rows' data are read with
        print("[bench] warm start: the embedded default's SFT phase", flush=True)
        run = areal_train(root, "warm", ["trainer.total_steps=0", "trainer.eval_every=0", "dataset.eval_size=8",
                                         *_task(args)])
        warm = str(run / "sft_warmup" / "hf")
    from transformers import AutoTokenizer

    from areal_cli.plan.compose import load_config
    from areal_cli.data.datasets import load_split

    # The built-in test split holds dataset.test_size items (200 by default): draw as many as are evaluated
    # (every test item is kept out of the train split, whatever the size).
    cfg = load_config([f"dataset.eval_size={args.eval_size}", f"dataset.test_size={max(200, args.eval_size)}",
                       f"cluster.fileroot={root}", *BIG, *_task(args)])
    tok = AutoTokenizer.from_pretrained(warm)
    train_items, _ = load_split(cfg.dataset, tok, "train", seed=cfg.seed)
    test_items = load_split(cfg.dataset, tok, "test", seed=cfg.seed)[0][: args.eval_size]
    if args.rounds > 0:
        rounds = seeded_rounds(root, "tiny", warm, args, args.rounds, train_items, cfg.seed)
        report(rounds, warm, test_items, args, "warm-started tiny model", gain=0.10)
    if args.big_rounds > 0:
        realistic_row(root, args, train_items, test_items, cfg.seed)


def seeded_rounds(root: str, row: str, warm: str, args: argparse.Namespace, times: int, train_items: list[dict],
                  data_seed: int) -> list[dict]:
    """``times`` passes over ``args.seeds``: one interleaved round of the three systems per seed, from the
    same warm start and the same data (areal's rows fixed by ``dataset.seed``, so only its sampling and
    prompt order move with ``seed``); each round's rows carry their ``seed``."""
    rounds = []
    for i in range(times):
        for s in args.seeds:
            extra = [*args.areal_args, f"seed={s}", f"dataset.seed={data_seed}"]
            sargs = argparse.Namespace(**{**vars(args), "trl_seed": s, "areal_args": extra})
            rows = compare(root, f"{row}_s{s}_r{i}", [f"model.path={warm}"], warm, sargs, args.steps,
                           args.ckpt_every, train_items)
            for r in rows.values():
                r["seed"] = s
            rounds.append(rows)
    return rounds


def _task(args: argparse.Namespace) -> list[str]:
    return [f"dataset.train_path=builtin:{args.task}"]


# The realistic row's model: the size of benchmarks/inference_throughput.py's.
BIG = ("model.path=builtin:tiny", "model.hidden_size=256", "model.num_hidden_layers=12",
       "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.intermediate_size=1024")
ASYNC, SYNC, TRL = "areal async (default)", "areal sync (k=0)", "TRL GRPOTrainer (cpu)"


def report(rounds: list[dict], warm: str, test_items: list[dict], args: argparse.Namespace, what: str,
           gain: float) -> None:
    """One evaluator over every round's checkpoints; per round its curves and time to target (warm start +
    ``gain`` unless ``--target``), then per system the curve as mean [min-max] and the time to target as the
    median over seeds and rounds with the worst, and the ratios against TRL and sync."""
    dirs = [warm] + [p for rows in rounds for r in rows.values() for _, p in r["checkpoints"].values()]
    print(f"[bench] evaluating {len(dirs)} checkpoints on {len(test_items)} held-out items", flush=True)
    acc = evaluate_dirs(dirs, test_items, args.max_new_tokens)
    base = acc[warm]
    target = args.target if args.target is not None else base + gain
    for rows in rounds:
        for r in rows.values():
            curve = [(s, acc[p], t) for s, (t, p) in sorted(r["checkpoints"].items())]
            r.update(final_acc=curve[-1][1], curve=[(s, a) for s, a, _ in curve],
                     time_to_target_s=next((t for _, a, t in curve if a >= target), None),
                     steps_to_target=next((s for s, a, _ in curve if a >= target), None))
    print(f"\n[{what}] same warm start (held-out {base:.1%}), task, prompts per step ({args.batch}), group "
          f"({args.group}), max new tokens ({args.max_new_tokens}), steps ({args.steps}); target {target:.1%}; "
          f"{len(rounds)} rounds over seeds {args.seeds}")
    print(f"{'round':>5s} {'seed':>4s} {'run':24s} {'samples/s':>10s} {'tokens/s':>9s} {'RL wall s':>10s} "
          f"{'tok/sample':>11s} {'final acc':>10s} {'t→target s':>11s}  curve (step: acc)")
    for i, rows in enumerate(rounds, 1):
        for k, r in rows.items():
            hit = r["time_to_target_s"]
            print(f"{i:5d} {r['seed']:4d} {k:24s} {r['samples_per_s']:10.2f} "
                  f"{r['samples_per_s'] * r['tokens_per_sample']:9.1f} {r['rl_wall_s']:10.1f} "
                  f"{r['tokens_per_sample']:11.2f} {r['final_acc']:10.1%} {'-' if hit is None else f'{hit:.0f}':>11s}"
                  "  " + " ".join(f"{s}:{a:.0%}" for s, a in r["curve"]))
    print_curves(rounds)
    print_time_to_target(rounds)
    print_throughput(rounds[0], what)
    if len(rounds) > 1:
        print_rounds(rounds)
    print(json.dumps({"warm": base, "target": target, "seeds": args.seeds, "areal_args": args.areal_args,
                      "rounds": [{k: {kk: vv for kk, vv in r.items() if kk != "checkpoints"} for k, r in rows.items()}
                                 for rows in rounds]}))


def print_curves(rounds: list[dict]) -> None:
    import statistics

    steps = sorted({s for rows in rounds for r in rows.values() for s, _ in r["curve"]})
    print(f"\nheld-out accuracy per checkpoint: mean [min-max] over {len(rounds)} rounds")
    print(f"{'system':24s} " + " ".join(f"{'step ' + str(st):>17s}" for st in steps))
    for name in rounds[0]:
        cells = []
        for st in steps:
            xs = [a for rows in rounds for s, a in rows[name]["curve"] if s == st]
            cells.append(f"{statistics.mean(xs):.1%} [{min(xs):.0%}-{max(xs):.0%}]" if xs else "-")
        print(f"{name:24s} " + " ".join(f"{c:>17s}" for c in cells))


def _median_missed(xs: list[float | None]) -> float | None:
    """The median of ``xs`` with a miss (None) counted as later than every hit; None when it lands on a miss."""
    import math

    ordered = sorted(xs, key=lambda x: math.inf if x is None else x)
    n = len(ordered)
    lo, hi = ordered[(n - 1) // 2], ordered[n // 2]
    return None if lo is None or hi is None else (lo + hi) / 2


def print_time_to_target(rounds: list[dict]) -> None:
    """Per system, the median and worst time (and steps) to target over seeds and rounds; per round the
    ratios of areal async to TRL and to sync, with their median (misses counted as later than any hit)."""
    fmt = lambda x, unit="s": "missed" if x is None else f"{x:.0f} {unit}"  # noqa: E731
    print(f"\ntime to target over {len(rounds)} rounds (seeds {sorted({r[TRL]['seed'] for r in rounds})}): "
          "median, worst")
    for name in rounds[0]:
        ts = [rows[name]["time_to_target_s"] for rows in rounds]
        steps = [rows[name]["steps_to_target"] for rows in rounds]
        worst = None if None in ts else max(ts)
        print(f"  {name:24s} median {fmt(_median_missed(ts)):>8s}, worst {fmt(worst):>8s}   steps: median "
              f"{fmt(_median_missed(steps), 'steps')}, per round "
              + ", ".join("-" if x is None else str(x) for x in steps))
    for name, other, goal in ((ASYNC, TRL, "<= 0.5x"), (ASYNC, SYNC, "<= 0.75x"), (SYNC, TRL, "")):
        ratios = []
        for rows in rounds:
            a, b = rows[name]["time_to_target_s"], rows[other]["time_to_target_s"]
            ratios.append(None if a is None else 0.0 if b is None else a / b)  # 0: only the other missed
        hit = [x for x in ratios if x is not None]
        med = _median_missed(ratios)
        print(f"  {name} / {other}: median " + ("missed" if med is None else f"{med:.2f}x")
              + (f", worst {max(hit):.2f}x" if hit and len(hit) == len(ratios) else ", worst: missed")
              + f" (per round: {', '.join('missed' if x is None else f'{x:.2f}' for x in ratios)}; 0.00: only "
              f"the second missed)" + (f"; goal {goal}" if goal else ""))


def realistic_row(root: str, args: argparse.Namespace, train_items: list[dict], test_items: list[dict],
                  data_seed: int) -> None:
    """Issue 23, item 3: the ~11.9M-param model warm-started (so rewards are not all zero), ``--big-new-tokens``
    new tokens, the three systems side by side in rounds over the seeds."""
    from areal_cli.models.tiny import model_param_count

    warm, bargs = big_warm_start(root, args)
    n = model_param_count(warm) / 1e6
    print(f"\n[bench] realistic row: {n:.1f}M params, warm-started, {args.big_new_tokens} new tokens, "
          f"{args.big_steps} steps at lr {args.big_lr}, seeds {args.seeds} x {args.big_rounds}", flush=True)
    rounds = seeded_rounds(root, "big", warm, bargs, args.big_rounds, train_items, data_seed)
    report(rounds, warm, test_items, bargs, f"{n:.1f}M params, warm-started, {args.big_new_tokens} new tokens",
           gain=0.10)


def big_warm_start(root: str, args: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """The realistic row's warm-started model (``--big-warm`` or ``--big-warm-steps`` SFT steps) and the
    arguments its runs take (its new tokens, steps, checkpoint interval, target and learning rate)."""
    warm = args.big_warm
    if warm is None:
        print(f"[bench] warm start of the big model: {args.big_warm_steps} SFT steps", flush=True)
        run = areal_train(root, "big_warm", [*BIG, "trainer.total_steps=0", "trainer.eval_every=0",
                                             "dataset.eval_size=8", *_task(args),
                                             f"trainer.sft_warmup_steps={args.big_warm_steps}",
                                             f"trainer.sft_lr={args.big_sft_lr}"])
        warm = str(run / "sft_warmup" / "hf")
    bargs = argparse.Namespace(**{**vars(args), "max_new_tokens": args.big_new_tokens, "steps": args.big_steps,
                                  "ckpt_every": args.big_ckpt_every, "target": args.big_target, "lr": args.big_lr})
    return warm, bargs


def print_rounds(rounds: list[dict]) -> None:
    import statistics

    print(f"\n[{len(rounds)} interleaved rounds] samples/s and ratios per round")
    print(f"{'round':>5s} {'seed':>4s} {'async':>8s} {'sync':>8s} {'TRL':>8s} {'async/TRL':>10s} {'async/sync':>11s} "
          f"{'async/sync, steps 3+':>21s}")
    r_t, r_s, r_ss = [], [], []
    for i, rows in enumerate(rounds, 1):
        ra, rs = rows[ASYNC], rows[SYNC]
        a, s, t = ra["samples_per_s"], rs["samples_per_s"], rows[TRL]["samples_per_s"]
        r_t.append(a / t)
        r_s.append(a / s)
        r_ss.append(ra["steady_samples_per_s"] / rs["steady_samples_per_s"])
        print(f"{i:5d} {ra['seed']:4d} {a:8.1f} {s:8.1f} {t:8.1f} {a / t:9.2f}x {a / s:10.2f}x {r_ss[-1]:20.2f}x")
    print(f"median ratio areal async / TRL: {statistics.median(r_t):.2f}x, worst {min(r_t):.2f}x (target >= 2x); "
          f"areal async / areal sync: {statistics.median(r_s):.2f}x (worst {min(r_s):.2f}x) over the whole RL "
          f"phase, {statistics.median(r_ss):.2f}x (worst {min(r_ss):.2f}x) in steady state (steps 3+) "
          "(target >= 1.4x)")


def print_throughput(rows: dict, what: str) -> tuple[dict, dict, dict]:
    a, s, t = (rows[n] for n in (ASYNC, SYNC, TRL))
    print(f"\n[{what}] samples/s: areal async {a['samples_per_s']:.2f}, areal sync {s['samples_per_s']:.2f}, "
          f"TRL {t['samples_per_s']:.2f}; tokens/sample {a['tokens_per_sample']:.2f} / "
          f"{s['tokens_per_sample']:.2f} / {t['tokens_per_sample']:.2f}")
    lens = [r["tokens_per_sample"] for r in (a, s, t)]
    if max(lens) > 1.15 * min(lens):
        print(f"WARNING: tokens per sample differ by more than 15% ({', '.join(f'{x:.2f}' for x in lens)}): "
              "the samples/s ratios below compare unequal work")
    print(f"ratio areal async / TRL samples/s: {a['samples_per_s'] / t['samples_per_s']:.2f}x (target >= 2x)")
    print(f"ratio areal async / areal sync samples/s: {a['samples_per_s'] / s['samples_per_s']:.2f}x "
          "(target >= 1.4x)")
    return a, s, t


if __name__ == "__main__":
    main()
