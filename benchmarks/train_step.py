"""One GRPO training step of the FSDP engine: shared-prefix packing vs one prompt copy per sample.

    python benchmarks/train_step.py                 # the embedded default's batch: 8 prompts x 8
    python benchmarks/train_step.py --group 16 --repeats 20

The batch has the embedded default's shape: built-in arithmetic prompts (ChatML, ~29 tokens), each
sampled ``--group`` times with completions of the default's length (~12 tokens: the worked solution,
its tokens perturbed and cut so completions differ). Rewards alternate so every group has advantages. The
model is the embedded default (``builtin:tiny``) unless ``--model`` names an HF dir.

Both variants run the same actor (PPO-clip, token-mean) on the same batch in one process (gloo,
world 1, one thread), alternating, after a warm-up step each; the script prints the median step time
of each, the tokens each forward processes, and the ratio. The two losses must agree (same inputs,
same weights: the first step of each variant starts from the same checkpoint).

``--compare-src DIR`` instead times this checkout's code against another's (``DIR``: that checkout's
``src``, e.g. a worktree at the parent commit), to measure a change of the training loop itself::

    git worktree add /tmp/base HEAD~1
    python benchmarks/train_step.py --compare-src /tmp/base/src --max-tokens-per-mb 256

Two worker processes (one per ``src``, same batch, same config, shared-prefix packing off so that
``--max-tokens-per-mb`` sets the micro-batch count) each run a warm-up step, then take turns, one step
each per round (the order alternating between rounds); the script prints the per-round ratio
this / other (median and worst) and checks that the first-step losses agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_batch(tok, items: list[dict], group: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for it in items:
        p_ids = list(it["prompt_ids"])
        answer = tok(it["solution"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        for _ in range(group):
            c = list(answer)
            for j in range(len(c) - 1):  # perturb: distinct completions of the default's length
                if torch.rand(1, generator=g).item() < 0.3:
                    c[j] = int(torch.randint(3, tok.vocab_size, (1,), generator=g))
            cut = int(torch.randint(max(1, len(c) - 4), len(c) + 1, (1,), generator=g))
            rows.append((p_ids, c[:cut]))
    L = max(len(p) + len(c) for p, c in rows)
    B = len(rows)
    ids = torch.full((B, L), tok.pad_token_id, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.bool)
    lm = torch.zeros(B, L)
    for r, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[r, :n] = torch.tensor(p + c)
        am[r, :n] = True
        lm[r, len(p):n] = 1.0
    logp = -torch.rand(B, L, generator=g) * lm
    rewards = torch.tensor([float((r // 2) % 2) for r in range(B)])
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "logprobs": logp, "rewards": rewards,
            "versions": torch.zeros(B, L, dtype=torch.long)}


def _setup(args):
    """Single-process world (gloo, one thread), config, model path, tokenizer, the batch."""
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from areal_cli.utils.network import find_free_port

    os.environ["MASTER_PORT"] = str(find_free_port())
    from transformers import AutoTokenizer

    from areal_cli.plan.compose import load_config
    from areal_cli.data.datasets import load_split
    from areal_cli.trainer.build import resolve_model_path

    root = tempfile.mkdtemp(prefix="areal_bench_train_")
    cfg = load_config([f"cluster.fileroot={root}", "algo.kl_coef=0"])
    model = args.model or resolve_model_path(cfg)
    tok = AutoTokenizer.from_pretrained(model)
    items, _ = load_split(cfg.dataset, tok, "train", seed=cfg.seed)
    return cfg, model, make_batch(tok, items[: args.prompts], args.group, seed=0)


_TAG = "@@train_step "  # libraries print to stdout too: the worker's answers carry this tag


def _say(obj) -> None:
    print(_TAG + json.dumps(obj), flush=True)


def _hear(proc) -> dict:
    for line in proc.stdout:
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG):])
    raise SystemExit(f"a benchmark worker exited (code {proc.wait()})")


def _worker(args) -> None:
    """One engine on stdin's orders: a line per step, answered with that step's time and loss."""
    from areal_cli.algorithms.actor import PPOActor
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.engines import packing
    from areal_cli.engines.fsdp import FSDPEngine

    cfg, model, batch = _setup(args)
    over = {"shared_prefix": False}
    if args.max_tokens_per_mb:
        over["max_tokens_per_mb"] = args.max_tokens_per_mb
    eng = FSDPEngine(type(cfg.engine)(**{**vars(cfg.engine), **over}), cfg.algo.optim, total_steps=10_000, seed=0)
    eng.initialize(ParallelStrategy(), model)
    actor = PPOActor(cfg.algo, eng, group_size=args.group, max_new_tokens=16)
    n_mb = len(packing.ffd_bins(packing.seq_lens(batch), eng.cfg.max_tokens_per_mb))
    _say({"ready": True, "micro_batches": n_mb})
    for _ in sys.stdin:
        b = actor.compute_advantages(batch)
        t0 = time.perf_counter()
        stats = actor.ppo_update(b)
        _say({"dt": time.perf_counter() - t0, "loss": stats["loss"]})
    eng.destroy()


def _compare(args) -> None:
    """This checkout's ``src`` against ``--compare-src``, interleaved (see the module docstring)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--prompts", str(args.prompts),
           "--group", str(args.group), "--max-tokens-per-mb", str(args.max_tokens_per_mb or 0)]
    if args.model:
        cmd += ["--model", args.model]
    procs = {}
    for name, src in (("this", here), ("other", os.path.abspath(args.compare_src))):
        env = {**os.environ, "PYTHONPATH": src}
        procs[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = {n: _hear(p) for n, p in procs.items()}

    def step(name):
        procs[name].stdin.write("step\n")
        procs[name].stdin.flush()
        return _hear(procs[name])

    first = {n: step(n)["loss"] for n in procs}  # warm-up step; its losses must agree
    times: dict[str, list[float]] = {n: [] for n in procs}
    for rep in range(args.repeats):
        for n in (("this", "other") if rep % 2 == 0 else ("other", "this")):
            times[n].append(step(n)["dt"])
    for p in procs.values():
        p.stdin.close()
        p.wait()
    ratios = [a / b for a, b in zip(times["this"], times["other"])]
    print(f"batch: {args.prompts} prompts x {args.group} samples, {info['this']['micro_batches']} micro-batches; "
          f"{args.repeats} interleaved rounds")
    for n in procs:
        print(f"{n:6s} median step {statistics.median(times[n]):.4f} s (min {min(times[n]):.4f}, "
              f"max {max(times[n]):.4f})   first-step loss {first[n]:.8f}")
    print(f"ratio this / other step time per round: median {statistics.median(ratios):.3f}, "
          f"worst {max(ratios):.3f}, best {min(ratios):.3f}")
    if abs(first["this"] - first["other"]) > 1e-6:
        raise SystemExit(f"first-step losses differ by {abs(first['this'] - first['other']):.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF dir (default: the embedded builtin:tiny model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compare-src", default=None,
                    help="another checkout's src dir: time this code against it (see the module docstring)")
    ap.add_argument("--max-tokens-per-mb", type=int, default=0,
                    help="with --compare-src: the micro-batch token budget (default: the config's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    if args.compare_src:
        return _compare(args)

    from areal_cli.algorithms.actor import PPOActor
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.engines import packing
    from areal_cli.engines.fsdp import FSDPEngine

    cfg, model, batch = _setup(args)
    lens = packing.seq_lens(batch)

    engines, actors = {}, {}
    for name, shared in (("one prompt copy per sample", False), ("shared prefix", True)):
        ecfg = type(cfg.engine)(**{**vars(cfg.engine), "shared_prefix": shared})
        eng = FSDPEngine(ecfg, cfg.algo.optim, total_steps=10_000, seed=0)
        eng.initialize(ParallelStrategy(), model)
        engines[name] = eng
        actors[name] = PPOActor(cfg.algo, eng, group_size=args.group, max_new_tokens=16)
    sp = packing.pack_shared(batch)
    tokens = {"one prompt copy per sample": sum(lens), "shared prefix": sp.input_ids.shape[1] if sp else sum(lens)}
    first_loss = {}
    times: dict[str, list[float]] = {n: [] for n in engines}
    for rep in range(args.repeats + 1):
        for name, actor in actors.items():
            b = actor.compute_advantages(batch)
            t0 = time.perf_counter()
            stats = actor.ppo_update(b)
            dt = time.perf_counter() - t0
            if rep == 0:
                first_loss[name] = stats["loss"]
            else:
                times[name].append(dt)
    print(f"batch: {args.prompts} prompts x {args.group} samples, {len(lens)} rows, {sum(lens)} tokens; "
          f"model {model}")
    for name in engines:
        print(f"{name:28s} forward tokens {tokens[name]:6d}   median step {statistics.median(times[name]):.4f} s "
              f"(min {min(times[name]):.4f})   first-step loss {first_loss[name]:.6f}")
    a, b = (statistics.median(times[n]) for n in engines)
    print(f"ratio one-copy / shared step time: {a / b:.2f}x")
    diff = abs(first_loss["shared prefix"] - first_loss["one prompt copy per sample"])
    if diff > 1e-5:
        raise SystemExit(f"losses differ by {diff:.3g}: the two packings are not computing the same thing")
    for eng in engines.values():
        eng.destroy()


if __name__ == "__main__":
    main()
