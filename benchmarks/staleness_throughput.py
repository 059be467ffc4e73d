"""Rollout throughput vs the staleness bound k, against real ``hf`` servers.

    python benchmarks/staleness_throughput.py --ks 0,1,2,4 --steps 6 --train-time 0.5

For each k it runs the trainer's loop with a weight update from disk every step:

1. take a batch with ``prepare_batch``;
2. "train" for ``--train-time`` seconds;
3. pause, push weights (alternating between two real checkpoints) and resume.

The training step is a sleep. In a real deployment the trainer runs on other devices, so a sleep
models it without taking the servers' CPU away. It prints the tokens consumed per second and each
k's ratio against k=0, measured in the same run. It also checks the staleness invariant on every
batch and exits non-zero if it is broken.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class KResult:
    k: int
    wall_s: float
    steps: int
    tokens: int
    max_stale: int
    mean_stale: float
    resumes: int

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s


async def length_reward(prompt: str, completion: str, answer) -> float:
    """Cheap, deterministic and non-constant, so groups have variance."""
    return float(len(completion) % 3 == 0)


def make_items(tokenizer, n: int) -> list[dict]:
    return [{"prompt": f"What is {i % 97} plus {(7 * i) % 89}?", "answer": str(i % 97 + (7 * i) % 89),
             "id": i} for i in range(n)]


def run_k(engine, tokenizer, weight_dirs: list[str], k: int, args) -> KResult:
    import torch

    from areal_cli.api.io_struct import GenerationConfig, WeightUpdateMeta
    from areal_cli.rollout import RolloutExecutor
    from areal_cli.rollout.workflows.rlvr import RLVRWorkflow

    wf = RLVRWorkflow(length_reward, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                      min_new_tokens=args.min_new_tokens),
                      tokenizer, group_size=args.group_size)
    ex = RolloutExecutor(engine, wf, batch_size=args.batch_size, max_concurrent=args.max_concurrent,
                         max_head_offpolicyness=k, pad_token_id=tokenizer.pad_token_id)
    data = make_items(tokenizer, 512)
    tokens = steps = resumes = 0
    stale: list[float] = []
    max_stale = 0
    t0 = 0.0
    try:
        for step in range(args.steps + 1):  # step 0 warms the pipeline up and is not timed
            if step == 1:
                t0 = time.monotonic()
                tokens = resumes = 0
                stale.clear()
            batch = ex.prepare_batch(data, timeout=600)
            v = ex.get_version()
            gen = batch.data["versions"][batch.data["loss_mask"]]
            lag = v - int(gen.min())
            if lag > k or (k == 0 and not bool(torch.all(gen == v))):
                raise SystemExit(f"staleness invariant broken: k={k} consumer={v} "
                                 f"oldest token={int(gen.min())}")
            max_stale = max(max_stale, lag)
            stale.append(ex.last_batch_stats["staleness/mean"])
            tokens += int(batch.data["loss_mask"].sum())
            resumes += sum(batch.meta.get("n_resumes", []))
            time.sleep(args.train_time)  # the trainer's step (on other devices)
            ex.pause()
            meta = WeightUpdateMeta(type="disk", version=v + 1, path=weight_dirs[(v + 1) % len(weight_dirs)])
            ex.run_coroutine(engine.pause_generation())
            ex.run_coroutine(engine.update_weights_from_disk(meta))
            ex.run_coroutine(engine.continue_generation())
            ex.set_version(v + 1)
            ex.resume()
            steps += step >= 1
        wall = time.monotonic() - t0
    finally:
        ex.run_coroutine(engine.close())  # the HTTP session lives on the executor's loop
        ex.destroy()
    return KResult(k, wall, steps, tokens, max_stale, sum(stale) / max(1, len(stale)), resumes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="0,1,2,4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4, help="episodes (prompts) per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--min-new-tokens", type=int, default=8)
    p.add_argument("--max-concurrent", type=int, default=64)
    p.add_argument("--train-time", type=float, default=0.5, help="simulated training step, seconds")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--model-dir", default=None, help="HF dir (default: build a tiny model)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.inference.launch import launch_server, wait_until_ready
    from areal_cli.models.tiny import make_tiny_model

    work = tempfile.mkdtemp(prefix="areal_bench_staleness_")
    if args.model_dir:
        dirs = [args.model_dir]
    else:
        a = make_tiny_model(os.path.join(work, "a"), seed=0, hidden_size=args.hidden_size,
                            num_layers=args.num_layers)
        b = make_tiny_model(os.path.join(work, "b"), tokenizer_dir=a, seed=1, hidden_size=args.hidden_size,
                            num_layers=args.num_layers)
        dirs = [a, b]
    tokenizer = AutoTokenizer.from_pretrained(dirs[0])
    servers = [launch_server("hf", dirs[0], wait=False, log_dir=work) for _ in range(args.servers)]
    try:
        for s in servers:
            wait_until_ready(s.address, 300, s.proc, s.log_path)
        engine = RemoteInferenceEngine([s.address for s in servers], backend="hf")
        results = [run_k(engine, tokenizer, dirs, int(k), args) for k in args.ks.split(",")]
    finally:
        for s in servers:
            s.stop()
    base = results[0]
    print(f"\nstaleness vs throughput: {args.servers} hf server(s), batch {args.batch_size} x group "
          f"{args.group_size}, max_new_tokens {args.max_new_tokens}, train step {args.train_time}s, "
          f"weight update every step, {args.steps} timed steps")
    print(f"{'k':>3} {'wall s':>8} {'tok/s':>9} {'vs k=' + str(base.k):>8} {'max stale':>10} "
          f"{'mean stale':>11} {'resumes':>8}")
    for r in results:
        print(f"{r.k:>3} {r.wall_s:>8.2f} {r.tok_per_s:>9.1f} {r.tok_per_s / base.tok_per_s:>8.2f}x "
              f"{r.max_stale:>10} {r.mean_stale:>11.2f} {r.resumes:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
