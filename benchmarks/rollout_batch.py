"""One GRPO rollout batch of the embedded default against the built-in hf server: new vs old code paths.

    python benchmarks/rollout_batch.py                   # new vs old, 15 interleaved batches each
    python benchmarks/rollout_batch.py --ablations       # plus servers with one new path switched off

The workload is what ``areal train`` sends each step with the default config: 64 concurrent
``RemoteInferenceEngine.agenerate`` calls = 8 distinct ChatML prompts x 8 samples (rlvr's
``asyncio.gather`` per group), ``max_new_tokens=16``, ``temperature=1.0``, eos stop, every sample
carrying its own ``seed`` (as ``trainer/rl.py``'s ``_SeededEngine`` does), on the built-in ``tiny``
model (Qwen2, hidden 128, 2 layers), each server on 1 torch thread.

Servers (all started in this run, batches interleaved round-robin so machine-speed drift hits
every server alike):
- ``new``: the defaults (hash-seeded sampling, shared-prompt prefill, ASGI ``/generate``);
- ``old``: ``--seeded-sampling generator --no-shared-prefill --generate-endpoint fastapi`` (the first two
  are the baseline paths of ``hf_baseline.py``, which starts that server; they left the product);
- with ``--ablations``: ``new`` minus one of the three paths each.
Per server: median wall time per 64-request batch and mean server CPU seconds per batch (the server
process tree, via psutil), with ratios ``old / new``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

from hf_baseline import launch as launch_hf  # same directory: the baseline paths live there
from inference_throughput import _tree_cpu  # same directory: process-tree CPU seconds

OLD = ["--seeded-sampling", "generator", "--no-shared-prefill", "--generate-endpoint", "fastapi"]
ABLATIONS = {"new-no-hash-sampling": ["--seeded-sampling", "generator"],
             "new-no-shared-prefill": ["--no-shared-prefill"],
             "new-fastapi-generate": ["--generate-endpoint", "fastapi"]}


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` distinct ChatML prompts shaped like the default arithmetic task (~29 tokens)."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"What is {17 + 7 * i} + {58 - 3 * i}? Answer:"}]
        enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


async def one_batch(engine, prompts: list[list[int]], group: int, gconfig, seed0: int) -> list[int]:
    """The rollout batch; returns the completion lengths."""
    from areal_cli.api.io_struct import ModelRequest

    async def episode(pi: int, prompt: list[int]):
        return await asyncio.gather(*[engine.agenerate(ModelRequest(
            input_ids=list(prompt), gconfig=gconfig.new(seed=seed0 + pi * group + k))) for k in range(group)])

    groups = await asyncio.gather(*[episode(i, p) for i, p in enumerate(prompts)])
    return [r.output_len for g in groups for r in g]


async def run(servers: dict, prompts: list[list[int]], args, gconfig) -> dict[str, dict[str, list[float]]]:
    from areal_cli.inference.client import RemoteInferenceEngine

    engines = {name: RemoteInferenceEngine([h.address], "hf", timeout_s=600) for name, h in servers.items()}
    res: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": [], "len": []} for n in servers}
    try:
        for name, eng in engines.items():  # warm-up: connections, first-call costs
            for _ in range(2):
                await one_batch(eng, prompts, args.group, gconfig, 0)
        for b in range(args.batches):
            for name, eng in engines.items():
                pid = servers[name].proc.pid
                c0, t0 = _tree_cpu(pid), time.perf_counter()
                lens = await one_batch(eng, prompts, args.group, gconfig, 1000 * (b + 1))
                res[name]["wall"].append(time.perf_counter() - t0)
                res[name]["cpu"].append(_tree_cpu(pid) - c0)
                res[name]["len"].append(statistics.mean(lens))
    finally:
        for eng in engines.values():
            await eng.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the built-in 'tiny' model (built in a temp dir)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batches", type=int, default=15, help="measured batches per server (interleaved)")
    ap.add_argument("--ablations", action="store_true", help="also time new minus each single path")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from areal_cli.api.io_struct import GenerationConfig
    from areal_cli.data.builtin_model import ensure_builtin_model
    from areal_cli.rollout.workflows.common import with_eos_stop

    path = args.model_path or ensure_builtin_model(tempfile.mkdtemp(prefix="bench_rollout_"), "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tok, args.prompts)
    gconfig = with_eos_stop(GenerationConfig(temperature=1.0, max_new_tokens=args.max_new_tokens), tok)
    variants = {"new": [], "old": OLD, **(ABLATIONS if args.ablations else {})}
    env = {"OMP_NUM_THREADS": "1"}
    servers = {}
    try:
        for name, extra in variants.items():
            servers[name] = launch_hf(path, ["--num-threads", "1", *extra], timeout_s=300, env=env)
        print(f"model {path}; {args.prompts} prompts x {args.group} samples "
              f"(prompt lens {sorted({len(p) for p in prompts})}), max_new_tokens={args.max_new_tokens}, "
              f"{args.batches} interleaved batches per server", flush=True)
        res = asyncio.run(run(servers, prompts, args, gconfig))
    finally:
        for h in servers.values():
            h.stop()
    # CPU: the mean (psutil reads 10 ms ticks, too coarse for a per-batch median); wall: the median.
    med = {n: (statistics.median(r["wall"]), statistics.mean(r["cpu"]), statistics.mean(r["len"]))
           for n, r in res.items()}
    new_wall, new_cpu, _ = med["new"]
    for name, (wall, cpu, mlen) in med.items():
        print(f"{name:24s} wall {wall * 1e3:7.1f} ms/batch (x{wall / new_wall:4.2f} of new)   "
              f"server cpu {cpu * 1e3:7.1f} ms/batch (x{cpu / new_cpu:4.2f} of new)   "
              f"mean completion {mlen:4.1f} tok", flush=True)
    old_wall, old_cpu, _ = med["old"]
    print(f"speed-up old/new: wall x{old_wall / new_wall:.2f}, server cpu x{old_cpu / new_cpu:.2f} "
          f"(load {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
