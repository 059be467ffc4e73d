"""Weight-sync and train-step throughput of the FSDP engine on CPU, all measured in one run.

    python benchmarks/weight_sync.py [--repeats 3] [--skip-train]

1. Builds a ~59M-parameter Qwen2 (``make_tiny_model`` with a bigger config) and starts the built-in
   ``hf`` server on it.
2. This process becomes a one-rank trainer and pushes its weights into the server with
   distributed sync (bf16 and fp32 on the wire; bf16 also with SGLang's one-broadcast-per-tensor
   protocol instead of the hf ``flattened_bucket`` extension) and disk sync (/dev/shm and a regular
   disk dir); it prints seconds per push (median and best of ``--repeats``) and the ratio against
   disk sync. Then a rank-8 LoRA engine on the same model pushes its adapter only (distributed and
   /dev/shm), and the ratio full push / adapter-only push is printed.
3. Launches dp=1 and dp=2 trainer processes (gloo) and prints train-step tokens/s, with dp=2 as a
   ratio of dp=1.

4. ``--busy``: only the push latency of the default embedded run instead — the built-in tiny model,
   one hf server kept busy generating, one-rank FSDP trainer — old path (explicit pause/continue
   round trips, new group per push as the trainer's new port asks) vs new path (pause/continue folded
   into the update request, group reused), in alternating blocks; prints phase medians and the ratio.

Timings on a shared 2-core machine are noisy; compare the ratios within one run.
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
from pathlib import Path

MODEL_CFG = dict(hidden_size=512, num_layers=15, num_heads=8, num_kv_heads=2, intermediate_size=2128,
                 tie_word_embeddings=True)


def build_model(root: Path) -> str:
    from areal_cli.models.tiny import make_tiny_model, model_param_count

    d = root / "model_59m"
    if not (d / "config.json").is_file():
        make_tiny_model(d, seed=0, **MODEL_CFG)
    print(f"model: {d} ({model_param_count(d) / 1e6:.1f}M params)")
    return str(d)



def bench_sync(model_dir: str, root: Path, repeats: int, only: list[str] | None = None,
               bucket_bytes: int = 32 * 1024**2) -> tuple[dict[str, float], dict[str, float]]:
    """Median and best seconds per push for each case."""
    from areal_cli.api.io_struct import ParallelStrategy, WeightUpdateMeta
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines.fsdp import FSDPEngine
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.inference.launch import launch_server
    from areal_cli.utils.concurrency import LoopRunner
    from areal_cli.utils.dist import init_distributed
    from areal_cli.utils.network import find_free_port

    shm = Path(tempfile.mkdtemp(prefix="areal_bench_", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="areal_bench_", dir=str(root)))
    server = launch_server("hf", model_dir, log_dir=str(root), timeout_s=300,
                           extra=["--allowed-weight-roots", str(shm), str(disk)])
    init_distributed("gloo")
    engine = FSDPEngine(EngineConfig(), None, total_steps=1, seed=0)
    engine.initialize(ParallelStrategy(), model_dir)
    client = RemoteInferenceEngine([server.address], retries=1)
    runner = LoopRunner()
    port = find_free_port()
    per_tensor = RemoteInferenceEngine([server.address], retries=1, flattened_bucket=False)  # SGLang protocol
    cases = {
        "distributed bf16": dict(type="distributed", dtype="bfloat16"),
        "distrib bf16 sglang": dict(type="distributed", dtype="bfloat16"),  # one broadcast per tensor
        "distributed fp32": dict(type="distributed", dtype="float32"),
        "disk /dev/shm": dict(type="disk", path=str(shm)),
        "disk regular": dict(type="disk", path=str(disk)),
    }
    # LoRA (rank 8, every projection): adapter-only pushes into the same server, after the full ones (the
    # adapter's distributed push joins a group of its own, which replaces the server's full-weight group).
    cases.update({
        "lora distributed bf16": dict(type="distributed", dtype="bfloat16"),
        "lora distributed": dict(type="distributed", dtype="float32"),
        "lora disk /dev/shm": dict(type="disk", path=str(shm)),
    })
    lora_engine = None
    results: dict[str, float] = {}
    best: dict[str, float] = {}
    try:
        for name, kw in cases.items():
            if only and name not in only:
                continue
            eng, cl = engine, per_tensor if "sglang" in name else client
            if name.startswith("lora"):
                if lora_engine is None:
                    from areal_cli.config.model import LoRAConfig
                    from areal_cli.weight_sync.lora import SERVED_NAME

                    lora_engine = FSDPEngine(EngineConfig(), None, total_steps=1, seed=0,
                                             lora=LoRAConfig(rank=8))
                    lora_engine.initialize(ParallelStrategy(), model_dir)
                    lora_client = RemoteInferenceEngine([server.address], retries=1, lora_name=SERVED_NAME)
                    port = find_free_port()  # the full-weight group still holds the first port's store
                eng, cl = lora_engine, lora_client
            times, best_phases = [], {}
            for i in range(repeats + 1):  # first push of each case is warm-up (group creation, page cache)
                meta = WeightUpdateMeta(master_port=port, timeout_s=120, bucket_bytes=bucket_bytes, **kw)
                t0 = time.perf_counter()
                eng.update_weights(meta, [cl], loop=runner.loop)
                dt = time.perf_counter() - t0
                if i:
                    if not times or dt < min(times):
                        best_phases = eng.last_sync_seconds
                    times.append(dt)
            results[name] = statistics.median(times)
            best[name] = min(times)
            phases = {k: round(v, 3) for k, v in best_phases.items()}
            print(f"  {name:18s} median {results[name]:7.3f} s  best {best[name]:7.3f} s  "
                  f"all {[round(t, 3) for t in times]}  (best push phases: {phases})", flush=True)
    finally:
        engine.destroy()
        if lora_engine is not None:
            lora_engine.destroy()
        runner.close()
        server.stop()
        for d in (shm, disk):
            subprocess.run(["rm", "-rf", str(d)], check=False)
    return results, best


# ------------------------------------------------------------------ push latency under load
def bench_busy(root: Path, pushes: int, blocks: int, concurrency: int, max_new: int) -> None:
    """Trainer-side seconds per distributed push while the server generates, old vs new path."""
    import asyncio
    import threading

    from areal_cli.api.io_struct import GenerationConfig, ModelRequest, ParallelStrategy, WeightUpdateMeta
    from areal_cli.config.engine import EngineConfig
    from areal_cli.data.builtin_model import ensure_builtin_model
    from areal_cli.engines.fsdp import FSDPEngine
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.inference.launch import launch_server
    from areal_cli.models.tiny import model_param_count
    from areal_cli.utils.concurrency import LoopRunner
    from areal_cli.utils.dist import init_distributed
    from areal_cli.utils.network import find_free_port
    from areal_cli.weight_sync.senders import DistributedSender

    model_dir = ensure_builtin_model(str(root), "tiny")
    print(f"push latency, busy server: builtin tiny ({model_param_count(model_dir) / 1e6:.2f}M params), "
          f"{concurrency} generations in flight, {blocks} blocks × {pushes} pushes per path", flush=True)
    server = launch_server("hf", model_dir, log_dir=str(root), timeout_s=300)
    init_distributed("gloo")
    engine = FSDPEngine(EngineConfig(), None, total_steps=1, seed=0)
    engine.initialize(ParallelStrategy(), model_dir)
    runner = LoopRunner()  # plays the rollout executor's loop: it also carries the generation traffic
    paths = {
        "old": (DistributedSender(runner, reuse_group=False, atomic=False),
                RemoteInferenceEngine([server.address], retries=1, atomic_update=False)),
        "new": (DistributedSender(runner), RemoteInferenceEngine([server.address], retries=1)),
    }
    gen = RemoteInferenceEngine([server.address], retries=1)
    stop = threading.Event()
    generated = [0]

    async def one() -> None:
        while not stop.is_set():
            r = await gen.agenerate(ModelRequest(input_ids=[5, 6, 7, 8, 9, 10], gconfig=GenerationConfig(
                max_new_tokens=max_new, min_new_tokens=max_new)))
            generated[0] += len(r.output_tokens)

    load = [asyncio.run_coroutine_threadsafe(one(), runner.loop) for _ in range(concurrency)]
    times: dict[str, list[float]] = {k: [] for k in paths}
    phases: dict[str, list[dict]] = {k: [] for k in paths}
    try:
        time.sleep(2.0)
        for _ in range(blocks):
            for name, (sender, client) in paths.items():
                sender.close()  # the other path replaced the server's group: start this block afresh
                engine._senders["distributed"] = sender
                for i in range(pushes + 1):  # the first push of a block makes the group: warm-up
                    meta = WeightUpdateMeta(type="distributed", master_port=find_free_port(), timeout_s=60)
                    t0 = time.perf_counter()
                    engine.update_weights(meta, [client], loop=runner.loop)
                    dt = time.perf_counter() - t0
                    if i:
                        times[name].append(dt)
                        phases[name].append(engine.last_sync_seconds)
                    time.sleep(0.05)
    finally:
        stop.set()
        for f in load:
            try:
                f.result(timeout=60)
            except Exception:
                pass
        for c in [gen] + [c for _, c in paths.values()]:
            runner.run(c.close())
        engine.destroy()
        runner.close()
        server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in paths:
        ph = {k: round(1000 * statistics.median(p[k] for p in phases[name]), 1)
              for k in ("pause", "group", "gather", "stage", "broadcast", "server_tail", "continue", "total")}
        print(f"  {name}: median {1000 * med[name]:6.1f} ms  best {1000 * min(times[name]):6.1f} ms  "
              f"(median phases, ms: {ph})", flush=True)
    print(f"  old / new: {med['old'] / med['new']:.2f}x (median), "
          f"{min(times['old']) / min(times['new']):.2f}x (best); {generated[0]} tokens generated meanwhile; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)


# ------------------------------------------------------------------ floor: the unavoidable work
def _raw_peer(port: int, numel: int, repeats: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, timeout)
    buf = torch.empty(numel, dtype=torch.bfloat16)
    for _ in range(repeats + 1):
        pg.broadcast(buf, 0).wait()


def bench_floor(model_dir: str, repeats: int) -> dict[str, float]:
    """Best-of-N seconds of the pieces no implementation can skip, measured now on this machine:
    fp32→bf16 cast on the trainer, one raw gloo broadcast of the bf16 bytes to another process,
    bf16→fp32 copy into the server's params (1 thread each, as during a sync)."""
    import datetime

    import torch
    import torch.distributed as dist

    from areal_cli.models.tiny import model_param_count
    from areal_cli.utils.network import find_free_port

    numel = model_param_count(model_dir)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    src, wire, dst = torch.randn(numel), torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel)
    res = {"cast": 1e9, "broadcast": 1e9, "apply": 1e9}
    port = find_free_port()
    peer = subprocess.Popen([sys.executable, __file__, "--raw-peer", str(port), str(numel), str(repeats)])
    try:
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout, wait_for_workers=False)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timeout)
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            wire.copy_(src)
            t1 = time.perf_counter()
            pg.broadcast(wire, 0).wait()
            t2 = time.perf_counter()
            dst.copy_(wire)
            t3 = time.perf_counter()
            if i:
                for k, v in (("cast", t1 - t0), ("broadcast", t2 - t1), ("apply", t3 - t2)):
                    res[k] = min(res[k], v)
    finally:
        peer.wait(timeout=60)
        torch.set_num_threads(prev)
    res["sum"] = res["cast"] + res["broadcast"] + res["apply"]
    return res


# ------------------------------------------------------------------ train-step throughput
def _train_worker(model_dir: str, out: str, steps: int, n_seqs: int, seq_len: int) -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines.fsdp import FSDPEngine
    from areal_cli.engines.packing import split_batch_for_dp
    from areal_cli.utils.dist import init_distributed

    rank, world = init_distributed("gloo")
    engine = FSDPEngine(EngineConfig(max_tokens_per_mb=2048), OptimConfig(lr=1e-5), total_steps=steps + 1, seed=0)
    engine.initialize(ParallelStrategy(dp=world), model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 300, (n_seqs, seq_len), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones(n_seqs, seq_len), "advantages": torch.randn(n_seqs, seq_len, generator=g)}
    local = split_batch_for_dp(batch, world)[engine.dp_rank]

    def loss_fn(o, mb):
        m = mb["loss_mask"]
        return -(o["logprobs"] * mb["advantages"] * m).sum() / m.sum(), {}

    def weight_fn(mb):
        return float(mb["loss_mask"].sum())

    engine.train_batch(local, loss_fn, weight_fn)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(local, loss_fn, weight_fn)
    dist.barrier()
    dt = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(json.dumps({"tokens_per_s": steps * n_seqs * seq_len / dt, "step_s": dt / steps}))
    engine.destroy()


def bench_train(model_dir: str, root: Path, steps: int, n_seqs: int, seq_len: int) -> dict[int, dict]:
    from areal_cli.utils.network import find_free_port

    res = {}
    for world in (1, 2):
        out = root / f"train_dp{world}.json"
        port = find_free_port()
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)),
                       HF_HUB_OFFLINE="1")
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", model_dir, str(out), str(steps),
                                           str(n_seqs), str(seq_len)], env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"train worker dp={world} failed: {codes}")
        res[world] = json.loads(out.read_text())
        print(f"  dp={world}: {res[world]['tokens_per_s']:8.1f} tokens/s  ({res[world]['step_s']:.2f} s/step)",
              flush=True)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-peer":
        _raw_peer(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _train_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default=None, help="work dir on a regular disk (default: a temp dir under /tmp)")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--bucket-mb", type=int, default=32,
                    help="distributed bucket size; buckets are pipelined (stage k+1 / broadcast k / apply k-1)")
    ap.add_argument("--only", nargs="*", default=None, help="sync cases to run, e.g. 'distributed bf16'")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--skip-sync", action="store_true", help="only the train-step part")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--busy", action="store_true",
                    help="only: push latency of the default tiny model into a busy server, old vs new path")
    ap.add_argument("--busy-pushes", type=int, default=10, help="pushes per block (--busy)")
    ap.add_argument("--busy-blocks", type=int, default=3, help="alternating old/new blocks (--busy)")
    ap.add_argument("--busy-concurrency", type=int, default=16, help="generations in flight (--busy)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(args.root or tempfile.mkdtemp(prefix="areal_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    if args.busy:
        bench_busy(root, args.busy_pushes, args.busy_blocks, args.busy_concurrency, max_new=64)
        return
    model_dir = build_model(root)
    if not args.skip_sync:
        report_sync(args, model_dir, root)
    if not args.skip_train:
        print(f"train step ({args.seqs}×{args.seq_len} tokens, fp32, gloo):")
        tr = bench_train(model_dir, root, args.train_steps, args.seqs, args.seq_len)
        print(f"  dp=2 / dp=1 throughput: {tr[2]['tokens_per_s'] / tr[1]['tokens_per_s']:.2f}x")


def report_sync(args, model_dir, root) -> None:
    print(f"weight sync (median seconds per push, server: hf on CPU, buckets {args.bucket_mb} MiB):")
    sync, best = bench_sync(model_dir, root, args.repeats, args.only, args.bucket_mb * 1024**2)
    base = sync.get("disk /dev/shm", next(iter(sync.values())))
    base_best = best.get("disk /dev/shm", next(iter(best.values())))
    for name, t in sync.items():
        print(f"  {name:18s} median {t:7.3f} s {base / t:5.2f}x   best {best[name]:7.3f} s "
              f"{base_best / best[name]:5.2f}x   vs disk /dev/shm")
    target = sync.get("distributed bf16")
    if target is not None:
        b = best["distributed bf16"]
        print(f"  target ≤0.25 s for distributed bf16: median {'met' if target <= 0.25 else 'NOT met'} "
              f"({target:.3f} s), best {'met' if b <= 0.25 else 'NOT met'} ({b:.3f} s)")
    for full, lora in (("distributed bf16", "lora distributed bf16"), ("distributed fp32", "lora distributed"),
                       ("disk /dev/shm", "lora disk /dev/shm")):
        if full in sync and lora in sync:
            r = sync[full] / sync[lora]
            print(f"  LoRA r8 adapter-only vs full push ({full}): {r:6.1f}x faster (median; best "
                  f"{best[full] / best[lora]:.1f}x); target ≥10x {'met' if r >= 10 else 'NOT met'}")
    floor = bench_floor(model_dir, args.repeats)
    print(f"  floor now (best of {args.repeats}, serial): cast fp32→bf16 {floor['cast']:.3f} s + raw gloo broadcast "
          f"{floor['broadcast']:.3f} s + copy bf16→fp32 {floor['apply']:.3f} s = {floor['sum']:.3f} s")
    print(f"  load average during the run: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
