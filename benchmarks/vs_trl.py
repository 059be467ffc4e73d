"""areal train (async) vs areal train (sync) vs TRL's GRPOTrainer, on this machine, in one run.

All three start from the same warm-started tiny model (an `areal train algo=sft` run, made first),
train GRPO on the built-in arithmetic task with the same prompts per step, group size, max new
tokens, learning rate and number of steps, and are evaluated on the same held-out items (greedy
pass@1). Printed:

- samples/s: generated samples trained on per second of the RL phase (prompts x group x steps /
  wall time from the first to the last step, start-up excluded for all three);
- time to reach ``--target`` held-out accuracy (seconds since the first step; "-" if never);
- ratios: areal async / TRL samples/s and areal async / areal sync samples/s.

    python benchmarks/vs_trl.py [--steps 20 --batch 8 --group 4 --max-new-tokens 8 --target 0.3]
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


def areal_figures(run_dir: Path, samples_per_step: int, target: float) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval" and r.get("phase", "rl") == "rl"]
    # RL phase: from the end of step 1 minus its duration to the last step (start-up excluded).
    t0 = train[0]["time"] - train[0]["perf/step_s"]
    wall = train[-1]["time"] - t0
    hit = next((r["time"] - t0 for r in evals if r["eval/pass@1"] >= target and r["step"] > 0), None)
    return {"samples_per_s": samples_per_step * len(train) / wall, "rl_wall_s": wall,
            "acc_before": evals[0]["eval/pass@1"], "acc_after": evals[-1]["eval/pass@1"],
            "time_to_target_s": hit}


def trl_run(model_dir: str, args: argparse.Namespace, test_items: list[dict], train_items: list[dict]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_cli.rewards import get_reward_fn

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    reward = get_reward_fn("numeric")

    def reward_fn(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward("", t, a)) for t, a in zip(texts, answer)]

    n_prompts = args.batch * args.steps
    ds = Dataset.from_list([{"prompt": it["messages"], "answer": it["answer"]} for it in train_items[:n_prompts]])
    out = tempfile.mkdtemp(prefix="trl_bench_")
    cfg = GRPOConfig(output_dir=out, use_cpu=True, num_generations=args.group,
                     per_device_train_batch_size=args.batch * args.group, max_completion_length=args.max_new_tokens,
                     learning_rate=args.lr, max_steps=args.steps, beta=0.0, temperature=1.0, logging_steps=1,
                     report_to="none", save_strategy="no", seed=1, disable_tqdm=True, num_iterations=1,
                     gradient_accumulation_steps=1, dataloader_num_workers=0, bf16=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def accuracy() -> float:
        model.eval()
        ok = 0
        with torch.no_grad():
            for it in test_items:
                ids = tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=True,
                                              return_tensors="pt")["input_ids"]
                gen = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
                ok += reward("", tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True), it["answer"]) > 0.5
        model.train()
        return ok / len(test_items)

    state = {"t0": None, "eval_s": 0.0, "hit": None, "evals": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, s, c, **kw):
            if state["t0"] is None:
                state["t0"] = time.time()

        def on_step_end(self, a, s, c, **kw):
            if s.global_step % args.eval_every == 0 or s.global_step == args.steps:
                t = time.time()
                acc = accuracy()
                state["eval_s"] += time.time() - t
                state["evals"].append(acc)
                elapsed = t - state["t0"] - (state["eval_s"] - (time.time() - t))
                if state["hit"] is None and acc >= args.target:
                    state["hit"] = elapsed

    before = accuracy()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    wall = time.time() - state["t0"] - state["eval_s"]
    return {"samples_per_s": args.batch * args.group * args.steps / wall, "rl_wall_s": wall,
            "acc_before": before, "acc_after": state["evals"][-1], "time_to_target_s": state["hit"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.3)
    ap.add_argument("--fileroot", default=None)
    args = ap.parse_args()
    root = args.fileroot or tempfile.mkdtemp(prefix="areal_bench_")
    common = [f"algo.batch_size={args.batch}", f"rollout.group_size={args.group}",
              f"rollout.gconfig.max_new_tokens={args.max_new_tokens}", f"algo.optim.lr={args.lr}",
              f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.eval_every}",
              f"dataset.eval_size={args.eval_size}", "trainer.sft_warmup_steps=0", "trainer.recover_every=0"]
    print(f"[bench] warm start: {args.sft_steps} SFT steps", flush=True)
    sft_dir = areal_train(root, "sft", ["algo=sft", f"trainer.total_steps={args.sft_steps}", "trainer.eval_every=0",
                                        "trainer.recover_every=0", f"dataset.eval_size={args.eval_size}"])
    warm = str(sft_dir / "checkpoints" / "final")
    spp = args.batch * args.group
    rows = {}
    print("[bench] areal async", flush=True)
    rows["areal async (k=2)"] = areal_figures(areal_train(root, "async", [f"model.path={warm}", *common,
                                              "rollout.max_head_offpolicyness=2"]), spp, args.target)
    print("[bench] areal sync", flush=True)
    rows["areal sync (k=0)"] = areal_figures(areal_train(root, "sync", [f"model.path={warm}", *common,
                                             "rollout.max_head_offpolicyness=0"]), spp, args.target)
    print("[bench] TRL GRPOTrainer", flush=True)
    from areal_cli.config.compose import load_config
    from areal_cli.data.datasets import load_split
    from transformers import AutoTokenizer

    cfg = load_config([f"dataset.eval_size={args.eval_size}"])
    tok = AutoTokenizer.from_pretrained(warm)
    train_items, _ = load_split(cfg.dataset, tok, "train", seed=cfg.seed)
    test_items, _ = load_split(cfg.dataset, tok, "test", seed=cfg.seed)
    rows["TRL GRPOTrainer (cpu)"] = trl_run(warm, args, test_items, train_items)

    print(f"\nsame model/task/prompts per step ({args.batch}) / group ({args.group}) / "
          f"max new tokens ({args.max_new_tokens}) / steps ({args.steps}); target accuracy {args.target:.0%}")
    print(f"{'run':24s} {'samples/s':>10s} {'RL wall s':>10s} {'acc before':>11s} {'acc after':>10s} "
          f"{'t→target s':>11s}")
    for k, r in rows.items():
        hit = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
        print(f"{k:24s} {r['samples_per_s']:10.2f} {r['rl_wall_s']:10.1f} {r['acc_before']:11.1%} "
              f"{r['acc_after']:10.1%} {hit:>11s}")
    a, s, t = (rows["areal async (k=2)"]["samples_per_s"], rows["areal sync (k=0)"]["samples_per_s"],
               rows["TRL GRPOTrainer (cpu)"]["samples_per_s"])
    print(f"\nratio areal async / TRL: {a / t:.2f}x (target >= 2x)")
    print(f"ratio areal async / areal sync: {a / s:.2f}x (target >= 1.4x)")


if __name__ == "__main__":
    main()
