"""``areal plan --calibrate``: measure this machine and return a :class:`HardwareProfile` of it.

Each measurement runs the real thing at a small size: GEMMs and a large copy in this process, the built-in
``hf`` server (a subprocess, as a run starts it) decoding a tiny model shaped like the embedded default, a
forward+backward and an optimizer step of that model, an all-reduce between two real processes (gloo on CPU,
NCCL between two GPUs), and a fresh interpreter that imports what a trainer rank imports. Every raw number goes
into ``HardwareProfile.calibrated``; the profile's fields are derived from them (see each ``_measure_*``).

Efficiency factors. A CPU profile's peaks are what this host achieves (a GEMM rate, a copy bandwidth, an
all-reduce bandwidth), so ``comm_eff`` is 1 and ``train_mfu``/``prefill_mfu`` are the fraction of the one-thread
GEMM rate that a training / forward pass of the tiny model reaches, both measured one-threaded (a CPU run gives
each process one thread), clamped to [0.3, 1]. On a GPU the peaks are measured too, but a tiny model says
nothing about a large one's MFU, so the datasheet profile's factors are re-expressed against the measured
peaks: cuBLAS reaches ~80% of the dense datasheet rate on large bf16 GEMMs, a device copy ~90% of the HBM
bandwidth, NCCL's all-reduce bus bandwidth ~80% of NVLink's; a GPU that measures as usual then gets the
datasheet profile's achieved rates and a slower one (power-capped, PCIe variant) proportionally less.

Torch is imported inside the functions: ``areal plan`` without ``--calibrate`` stays torch-free.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from areal_cli.allocation.hardware import PROFILES, HardwareProfile

GIB = 1024 ** 3
Progress = Callable[[int, int, str], None]  # (index of the measurement starting, how many, what it is)

STEPS = ("GEMM rate", "memory bandwidth", "hf server decode", "train micro-batch and optimizer step",
         "all-reduce bandwidth, process memory and the engines' RL step")
# Fractions of the datasheet that a healthy GPU's best GEMM / copy / all-reduce reach (module docstring).
_GPU_GEMM_OF_PEAK, _GPU_COPY_OF_PEAK, _GPU_NCCL_OF_PEAK = 0.8, 0.9, 0.8
# What a trainer rank and a server import before they hold a model: their resident memory is the floor of
# every process of a run.
_RANK_IMPORTS = ("torch", "transformers", "areal_cli.trainer.rl", "areal_cli.engines.fsdp",
                 "areal_cli.trainer.entry")
# The embedded default model's shape (conf/model/tiny.yaml), so the fixed costs measured are the ones its
# runs pay.
_TINY_SHAPE = {"hidden_size": 128, "intermediate_size": 512, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
               "max_position_embeddings": 512}


def calibrate(name: str = "cpu", quick: bool = False, progress: Progress | None = None) -> HardwareProfile:
    """Measure this machine (~60 s on two cores, ~25 s with ``quick``) and return its profile, named ``name``.
    ``progress(i, n, label)`` is called as measurement ``i`` of ``n`` starts, and with ``i == n`` at the end."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # deepspeed (imported by transformers when installed) would log a line to say so
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    raw: dict = {"quick": quick, "device": "cuda" if cuda else "cpu", "cpu_cores": os.cpu_count() or 1,
                 "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "step_seconds": {}}
    t_start = time.perf_counter()
    allreduce: _AllReduce | None = None

    def decode(tmp: str) -> dict:
        nonlocal allreduce
        model_dir = _tiny_model(tmp)
        allreduce = _AllReduce(cuda, quick, model_dir)  # its ranks start up beside the server (see _AllReduce)
        return _measure_decode(model_dir, cuda, quick, tmp, before_timing=allreduce.wait_ready)

    with tempfile.TemporaryDirectory(prefix="areal_calibrate_") as tmp:
        steps = [(STEPS[0], lambda: _measure_gemm(cuda, quick)), (STEPS[1], lambda: _measure_copy(cuda, quick)),
                 (STEPS[2], lambda: decode(tmp)),
                 (STEPS[3], lambda: _measure_train(os.path.join(tmp, "model"), quick)),
                 (STEPS[4], lambda: allreduce.finish())]
        try:
            for i, (label, measure) in enumerate(steps):
                if progress is not None:
                    progress(i, len(steps), label)
                t0 = time.perf_counter()
                raw.update(measure())
                raw["step_seconds"][label] = round(time.perf_counter() - t0, 2)
        finally:
            if allreduce is not None:
                allreduce.close()
    raw["mem_gb"] = _device_memory_gb(cuda)
    raw["seconds"] = round(time.perf_counter() - t_start, 1)
    if progress is not None:
        progress(len(steps), len(steps), "done")
    return _profile(name, raw)


def _profile(name: str, raw: dict) -> HardwareProfile:
    """The profile from the raw measurements (module docstring: how the efficiency factors are chosen)."""
    over = {"decode_iter_s": raw["decode_iter_s"], "request_s": raw["request_s"], "train_mb_s": raw["train_mb_s"],
            "optim_step_s": raw["optim_step_s"], "process_base_gb": raw["process_base_gb"], "mem_gb": raw["mem_gb"],
            "calibrated": raw}
    if raw.get("server_rss_gb"):  # the tiny model's weights and KV are noise against the server's own base
        over["server_base_gb"] = raw["server_rss_gb"]
    if raw["device"] == "cpu":  # the built-in server's per-row cost (Python sampling and bookkeeping)
        over["decode_row_s"] = raw.get("decode_token_s", 0.0)
    if raw.get("allreduce_latency_s"):  # a small collective's round trip: what TP pays per layer and op
        over["collective_s"] = raw["allreduce_latency_s"]
    if "tp_layer_s" in raw:  # CPU: the t2 engine against d1 (_tp_terms)
        over.update(tp_layer_s=raw["tp_layer_s"], tp_token_eff=raw["tp_token_eff"])
    if raw["device"] == "cpu":
        bw = raw["allreduce_gbs"]
        train_mfu = _clamp(raw["train_mfu"], 0.3, 1.0)
        if raw.get("rl_steps"):  # the engines' own RL step (_rl_steps), against one thread's GEMM share
            per_thread = raw["gemm_tflops"] * 1e12 / max(1, raw["cpu_cores"])
            points = [[p["hidden"], p["mb_tokens"], _clamp(p["flops"] / p["seconds"] / per_thread, 0.02, 1.5)]
                      for p in raw["rl_steps"]]
            # each point is a whole update (one micro-batch and the optimizer step): its fixed costs are
            # inside its rate, so none go on top
            over.update(train_mfu_points=points, train_mb_s=0.0, optim_step_s=0.0)
            train_mfu = points[0][2]
        return replace(PROFILES["cpu"], name=name, matmul_tflops=raw["gemm_tflops"], mem_bw_gbs=raw["copy_gbs"],
                       intra_node_gbs=bw, inter_node_gbs=bw, train_mfu=train_mfu,
                       prefill_mfu=_clamp(raw["prefill_mfu"], 0.3, 1.0), comm_eff=1.0,
                       source=f"measured by `areal plan --calibrate` on this host ({raw['cpu_cores']} cores, "
                              f"{raw['when']})", **over)
    base = PROFILES[raw["gpu_base"]]
    gemm = raw["gemm_tflops"]
    fields = {"matmul_tflops": gemm, "mem_bw_gbs": raw["copy_gbs"],
              "train_mfu": _clamp(base.train_mfu / _GPU_GEMM_OF_PEAK, 0.05, 1.0),
              "prefill_mfu": _clamp(base.prefill_mfu / _GPU_GEMM_OF_PEAK, 0.05, 1.0),
              "decode_bw_eff": _clamp(base.decode_bw_eff / _GPU_COPY_OF_PEAK, 0.05, 1.0)}
    if raw.get("allreduce_gbs"):  # measured between two GPUs; one GPU keeps the datasheet's link
        fields.update(intra_node_gbs=raw["allreduce_gbs"],
                      comm_eff=_clamp(base.comm_eff / _GPU_NCCL_OF_PEAK, 0.05, 1.0))
    return replace(base, name=name, source=f"measured by `areal plan --calibrate` on {raw['gpu_name']} "
                                           f"({raw['when']}); links and network from {base.source}",
                   **fields, **over)


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, float(x)))


def _best_rate(fn: Callable[[], None], work: float, budget_s: float, sync: Callable[[], None]) -> float:
    """``work`` per second of ``fn`` at its best: batches of calls timed over ``budget_s``, the fastest batch
    wins (other processes on a shared host only ever slow a batch down)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    per_batch = max(1, int(0.05 / once))  # batches of ~50 ms: long enough to time, short enough to repeat
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / per_batch)
        if time.perf_counter() >= deadline:
            return work / best


def _sync(cuda: bool) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if cuda else (lambda: None)


def _measure_gemm(cuda: bool, quick: bool) -> dict:
    """Square GEMMs at a few sizes, best sustained rate: fp32 on CPU with all threads (the host's rate) and
    with one (what one process of a CPU run gets), bf16 on a GPU."""
    import torch

    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sizes = ((2048, 4096) if quick else (2048, 4096, 8192)) if cuda else ((256, 512) if quick else (256, 512, 1024))
    budget = 0.3 if quick else 0.6
    rates = {}
    for n in sizes:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        out = torch.empty(n, n, device=dev, dtype=dtype)
        rates[n] = _best_rate(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), 2.0 * n ** 3, budget,
                              _sync(cuda)) / 1e12
    res = {"gemm_tflops_by_size": {str(k): round(v, 6) for k, v in rates.items()},
           "gemm_tflops": max(rates.values()), "gemm_dtype": str(dtype).removeprefix("torch.")}
    if not cuda:
        with _threads(1):
            n = 512
            a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
            res["gemm_tflops_1thread"] = _best_rate(lambda: torch.mm(a, b, out=out), 2.0 * n ** 3, budget,
                                                    _sync(False)) / 1e12
        # Threads that lose their cores to other processes can make the host's GEMM slower than one thread's;
        # the host can always do at least what one thread does.
        res["gemm_tflops"] = max(res["gemm_tflops"], res["gemm_tflops_1thread"])
    else:
        res["gpu_name"] = torch.cuda.get_device_name(0)
        res["gpu_base"] = _gpu_kind(res["gpu_name"])
    return res


def _gpu_kind(device_name: str) -> str:
    """The built-in profile a GPU's name matches (its links and efficiency factors); h100 when none does."""
    low = device_name.lower()
    for kind in ("h200", "h100", "b200", "a100", "l40s"):
        if kind in low:
            return kind
    return "h100"


class _threads:
    """torch's intra-op threads set for a block (restored after)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        import torch

        self.prev = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.prev)


def _measure_copy(cuda: bool, quick: bool) -> dict:
    """A large tensor copy (read + write), far bigger than any cache: the STREAM-like bandwidth."""
    import torch

    dev = "cuda" if cuda else "cpu"
    n = (1 << 28 if not quick else 1 << 27) if cuda else (1 << 25 if quick else 1 << 26)  # float32 elements
    src = torch.ones(n, device=dev)
    dst = torch.empty(n, device=dev)
    budget = 0.3 if quick else 0.6
    gbs = _best_rate(lambda: dst.copy_(src), 2.0 * 4 * n, budget, _sync(cuda)) / 1e9
    res = {"copy_gbs": gbs, "copy_bytes": 4 * n}
    if not cuda:
        with _threads(1):
            res["copy_gbs_1thread"] = _best_rate(lambda: dst.copy_(src), 2.0 * 4 * n, budget, _sync(False)) / 1e9
        res["copy_gbs"] = max(res["copy_gbs"], res["copy_gbs_1thread"])
    return res


def _tiny_model(tmp: str) -> str:
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(os.path.join(tmp, "model"), **_TINY_SHAPE)


def _measure_decode(model_dir: str, cuda: bool, quick: bool, tmp: str,
                    before_timing: Callable[[], None] | None = None) -> dict:
    """The built-in server's decode on the tiny model: batch 1 and batch 8, each at a short and a long
    generation, every request generating exactly its tokens (EOS ignored), over one kept-alive connection
    pool as the rollout client keeps one.

    A request of ``n`` new tokens at batch ``b`` takes ``request_s + n * iter(b)``, with one decode iteration
    ``iter(b) = decode_iter_s + b * token_s``. Two lengths give ``iter(b)`` (the slope) and ``request_s`` (the
    intercept at batch 1); two batch sizes split ``iter`` into its fixed part and the per-sequence part."""
    from areal_cli.inference.launch import launch_server, wait_until_ready

    env = {} if cuda else {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    short, long_ = (4, 32) if quick else (4, 64)
    repeats = 2 if quick else 3
    server = launch_server("hf", model_dir, log_dir=os.path.join(tmp, "logs"), timeout_s=180, env=env,
                           device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", wait=False)
    try:
        wait_until_ready(server.address, 180, server.proc, server.log_path)
        if before_timing is not None:
            before_timing()
        times = _run_async(_decode_times(f"http://{server.address}", short, long_, repeats))
        res = {"server_rss_gb": _rss_gb(server.proc.pid) if server.proc.pid else None}
    finally:
        server.stop()
    it1 = (times[1, long_] - times[1, short]) / (long_ - short)
    it8 = (times[8, long_] - times[8, short]) / (long_ - short)
    token_s = max((it8 - it1) / 7, 0.0)
    res.update({"decode_times_s": {f"b{b}_n{n}": round(t, 5) for (b, n), t in times.items()},
                "decode_iter_b1_s": it1, "decode_iter_b8_s": it8, "decode_token_s": token_s,
                "decode_iter_s": max(it1 - token_s, 1e-5), "request_s": max(times[1, short] - short * it1, 1e-5)})
    return res


def _run_async(coro):
    import asyncio

    return asyncio.run(coro)


async def _decode_times(base: str, short: int, long_: int, repeats: int) -> dict:
    """``{(batch, new_tokens): best wall time}`` of ``batch`` concurrent ``/generate`` requests."""
    import asyncio

    import httpx

    prompt = list(range(10, 26))  # 16 tokens, ids inside the tiny tokenizer's vocabulary

    async def batch(c, b: int, n: int) -> float:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "min_new_tokens": n,
                                                         "temperature": 1.0, "ignore_eos": True}}
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[c.post(f"{base}/generate", json=body) for _ in range(b)])
        dt = time.perf_counter() - t0
        for r in rs:
            r.raise_for_status()
            got = len(r.json()["output_ids"])
            if got != n:
                raise RuntimeError(f"the hf server generated {got} tokens where {n} were asked")
        return dt

    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        await batch(c, 8, 8)  # warm-up: connections, first-request allocations, lazy imports
        await batch(c, 1, 8)
        out: dict = {}
        for _ in range(repeats):  # interleaved, so a burst of load elsewhere does not hit one cell only
            for b in (1, 8):
                for n in (short, long_):
                    out[b, n] = min(out.get((b, n), float("inf")), await batch(c, b, n))
    return out


def _measure_train(model_dir: str, quick: bool) -> dict:
    """Forward+backward of one micro-batch at two lengths, one thread (a CPU rank's share of a two-core host).
    The intercept of time against tokens is the per-micro-batch cost no FLOP count explains; the slope against
    ``6 * params`` FLOPs per token is the training rate, as a fraction of the one-thread GEMM rate."""
    import torch
    from transformers import AutoModelForCausalLM

    lens = (64, 512)
    repeats = 3 if quick else 5
    with _threads(1):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        vocab = model.config.vocab_size
        n_params = sum(p.numel() for p in model.parameters())
        fwd, step = {}, {}
        for t in lens:
            ids = torch.randint(10, vocab - 10, (1, t))

            def fb(ids=ids):
                model(input_ids=ids, labels=ids).loss.backward()

            def f(ids=ids):
                with torch.no_grad():
                    model(input_ids=ids)

            fb()
            step[t] = min(_timed(fb) for _ in range(repeats))
            fwd[t] = min(_timed(f) for _ in range(repeats))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def optim_step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)

        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optim_step()
        optim = statistics.median(_timed(optim_step) for _ in range(10 if quick else 20))
        gemm1 = _gemm_1thread_rate()
    lo, hi = lens
    slope = (step[hi] - step[lo]) / (hi - lo)
    fslope = (fwd[hi] - fwd[lo]) / (hi - lo)
    return {"train_params": n_params, "train_step_s_by_tokens": {str(k): v for k, v in step.items()},
            "forward_s_by_tokens": {str(k): v for k, v in fwd.items()},
            "train_mb_s": max(step[lo] - lo * slope, 1e-5), "optim_step_s": optim,
            "train_tflops_1thread": 6 * n_params / max(slope, 1e-9) / 1e12,
            "forward_tflops_1thread": 2 * n_params / max(fslope, 1e-9) / 1e12,
            "train_mfu": 6 * n_params / max(slope, 1e-9) / gemm1,
            "prefill_mfu": 2 * n_params / max(fslope, 1e-9) / gemm1}


def _gemm_1thread_rate() -> float:
    import torch

    n = 512
    a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    return _best_rate(lambda: torch.mm(a, b, out=out), 2.0 * n ** 3, 0.2, _sync(False))


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# One micro-batch of rows × length tokens, small and large: the fixed part and the per-token slope.
_TP_SHAPES = [[1, 48], [32, 48]]


def _tp_terms(d1: dict, tp2: dict) -> dict:
    """The t2 engine's step against the d1 engine's at the same shapes (:data:`_TP_SHAPES`): the extra
    fixed cost of one micro-batch, per layer per pass-unit (forward 1 + backward 2 = 3), and the share of
    the ideal halving of the per-token cost that t2 reaches."""
    (r0, l0), (r1, l1) = _TP_SHAPES
    small, large = f"{r0}x{l0}", f"{r1}x{l1}"
    layers = _TINY_SHAPE["num_layers"]
    extra = max(0.0, tp2[small] - d1[small])
    tokens = r1 * l1 - r0 * l0
    slope_d1 = max(1e-9, (d1[large] - d1[small]) / tokens)
    slope_tp = max(1e-9, (tp2[large] - tp2[small]) / tokens)
    return {"tp2_step_s": tp2, "d1_step_s": d1, "tp_layer_s": extra / (3 * layers),
            "tp_token_eff": _clamp(slope_d1 / 2 / slope_tp, 0.05, 1.0)}


class _AllReduce:
    """Two real processes that first import what a trainer rank imports and then all-reduce: gloo on CPU,
    NCCL between GPUs 0 and 1; with one GPU a single process only reports its memory. On CPU, rank 0 then
    builds and steps the FSDP engine on ``model_dir`` (:func:`_running_rank`): its memory beyond the model
    is ``process_base_gb``; elsewhere the memory after the imports is. Bus bandwidth as nccl-tests defines it (``bytes * 2(n-1)/n / time``,
    = bytes/time for two ranks).

    The ranks start (imports, rendezvous) while the server starts, then wait for a go file: start-up is most of
    their time, and only the all-reduces themselves are timed. :meth:`wait_ready` returns once they are idle, so
    the decode timing does not share the cores with their imports."""

    def __init__(self, cuda: bool, quick: bool, model_dir: str | None = None):
        import torch

        from areal_cli.utils.network import find_free_port

        self.tmp = tempfile.TemporaryDirectory(prefix="areal_allreduce_")
        world = 1 if cuda and torch.cuda.device_count() < 2 else 2
        self.sizes = (1 << 26, 1 << 28) if cuda else (1 << 20, 1 << 23) if quick else (1 << 20, 1 << 24)
        spec = {"world": world, "port": find_free_port(), "backend": "nccl" if cuda else "gloo",
                "sizes": list(self.sizes), "iters": 3 if quick else 5, "dir": self.tmp.name,
                "imports": list(_RANK_IMPORTS), "model_dir": model_dir, "tp_shapes": _TP_SHAPES}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        code = ("import json, sys; from areal_cli.planner.calibrate import _allreduce_worker as w; "
                "w(int(sys.argv[1]), json.loads(sys.argv[2]))")
        self.procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), json.dumps(spec)], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                      for rank in range(world)]

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(Path(self.tmp.name, f"ready{r}").exists() for r in range(len(self.procs))):
            if any(p.poll() not in (None, 0) for p in self.procs) or time.monotonic() > deadline:
                self._fail()
            time.sleep(0.05)

    def finish(self) -> dict:
        try:
            Path(self.tmp.name, "go").touch()
            for p in self.procs:
                p.communicate(timeout=300)
                if p.returncode != 0:
                    self._fail()
            res = json.loads(Path(self.tmp.name, "result.json").read_text())
        finally:
            self.close()
        out = {"process_base_gb": res["rss_kb"] * 1024 / GIB, "process_base_imports": list(_RANK_IMPORTS)}
        if res.get("running_base_kb"):  # a running rank (CPU): what a trainer process really holds
            out.update(process_base_gb=res["running_base_kb"] * 1024 / GIB,
                       imports_base_gb=res["rss_kb"] * 1024 / GIB, rank_hwm_gb=res["rank_hwm_kb"] * 1024 / GIB,
                       rank_model_params=res["rank_model_params"])
        if res.get("tp2_step_s") and res.get("d1_step_s"):
            out.update(_tp_terms(res["d1_step_s"], res["tp2_step_s"]))
        if res.get("rl_steps"):
            out["rl_steps"] = res["rl_steps"]
        if "times" not in res:
            return {**out, "allreduce_gbs": None, "allreduce_note": "one GPU: the datasheet's link is kept"}
        by_size = {str(s): s / t / 1e9 for s, t in zip(self.sizes, res["times"])}
        return {**out, "allreduce_backend": res["backend"], "allreduce_gbs_by_bytes": by_size,
                "allreduce_gbs": max(by_size.values()), "allreduce_latency_s": res["latency_s"]}

    def _fail(self) -> None:
        errs = []
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            errs += (p.communicate()[1] or "").strip().splitlines()[-1:]
        raise RuntimeError(f"the all-reduce/memory measurement's process failed: {errs[-1] if errs else 'no output'}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        self.procs = []
        self.tmp.cleanup()


def _allreduce_worker(rank: int, spec: dict) -> None:
    """One rank of :class:`_AllReduce` (its subprocess)."""
    import importlib

    for m in spec["imports"]:
        importlib.import_module(m)
    rss_kb = int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = spec["backend"] == "nccl"
    out, world = Path(spec["dir"], "result.json"), spec["world"]
    if world < 2:
        Path(spec["dir"], f"ready{rank}").touch()
        out.write_text(json.dumps({"rss_kb": rss_kb}))
        return
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(spec["backend"], init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world)
    dev = f"cuda:{rank}" if cuda else "cpu"
    Path(spec["dir"], f"ready{rank}").touch()
    go = Path(spec["dir"], "go")
    deadline = time.monotonic() + 600
    while not go.exists():  # the parent is timing other things meanwhile: poll without using a core
        if time.monotonic() > deadline:
            raise SystemExit("no go file after 600 s: the calibration that started this rank is gone")
        time.sleep(0.05)

    from areal_cli.utils import collectives as C

    def run(n_bytes: int, reps: int) -> float:
        x = torch.ones(n_bytes // 4, device=dev)
        C.all_reduce(x)  # warm-up: connection set-up and buffers
        best = float("inf")
        for _ in range(reps):
            C.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            C.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    try:
        latency = run(4096, 10)
        times = [run(s, spec["iters"]) for s in spec["sizes"]]
        result = {"backend": spec["backend"], "times": times, "latency_s": latency, "rss_kb": rss_kb}
        engines = not cuda and spec.get("model_dir")
        if engines:  # the same steps on a t2 layout of the project's DTensor engine (archon), both ranks
            result["tp2_step_s"] = _engine_steps("archon", spec["model_dir"], spec["tp_shapes"], tp=2)[0]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        if engines:
            d1, mem = _engine_steps("fsdp", spec["model_dir"], spec["tp_shapes"], tp=1)
            result.update(d1_step_s=d1, **mem)
            result["rl_steps"] = _rl_steps(spec["model_dir"], spec["dir"])
        out.write_text(json.dumps(result))


def _engine_steps(name: str, model_dir: str, shapes: list[list[int]], tp: int) -> tuple[dict, dict]:
    """``train_batch`` of the project's ``name`` engine (fsdp or archon, ``tp``-way) on the tiny model, one
    micro-batch of ``rows × length`` tokens per shape: the best of 3 after a warm-up, one thread per rank.

    Also the rank's resident memory beyond its model's states (fsdp, one rank): what a training process
    holds once it runs (the engine's modules and buffers, the allocator's pools, gloo), less the tiny
    model's weights, gradients and AdamW moments. A process that only imported the trainer holds about
    half of it. The kernel's high-water mark is reset first (``clear_refs`` 5), so the all-reduce
    buffers before it do not count."""
    import torch

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig

    if name == "archon":
        from areal_cli.engines.archon.engine import ArchonEngine as Engine
    else:
        from areal_cli.engines.fsdp import FSDPEngine as Engine
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the high-water mark then includes the all-reduces'
        pass
    engine = Engine(EngineConfig(max_tokens_per_mb=1 << 20), OptimConfig(lr=1e-5), total_steps=100)
    engine.initialize(ParallelStrategy(tp=tp), model_dir)
    n_params = sum(p.numel() for p in engine.model.parameters())

    def loss(out, mb):
        m = mb["loss_mask"]
        return -(out["logprobs"] * m).sum() / m.sum().clamp(min=1), {}

    times = {}
    for rows, length in shapes:
        ids = torch.randint(10, 300, (rows, length), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(rows, length)
        mask[:, : length // 2] = 0
        batch = {"input_ids": ids, "attention_mask": torch.ones(rows, length, dtype=torch.bool),
                 "loss_mask": mask}
        engine.train_batch(batch, loss, lambda mb: mb["loss_mask"].sum())
        times[f"{rows}x{length}"] = min(
            _timed(lambda: engine.train_batch(batch, loss, lambda mb: mb["loss_mask"].sum())) for _ in range(3))
    if tp > 1:
        return times, {}
    hwm_kb = int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))
    states = n_params * 16  # fp32 weights, gradients and two AdamW moments (fsdp at d1 holds them whole)
    return times, {"rank_hwm_kb": hwm_kb, "rank_model_params": n_params,
                   "running_base_kb": max(0, hwm_kb - states // 1024)}


# The engines' RL step, measured at two model widths (the embedded default's, and one twice as wide) and two
# micro-batch sizes each: GRPO groups of 8 over a shared 29-token prompt with 16 new tokens, as the
# embedded task's batches are.
_RL_WIDE = {**_TINY_SHAPE, "hidden_size": 256, "intermediate_size": 1024, "num_layers": 4, "num_heads": 8,
            "num_kv_heads": 4}
_RL_ROWS = {_TINY_SHAPE["hidden_size"]: (32, 128, 256), _RL_WIDE["hidden_size"]: (32, 128)}
_RL_GROUP, _RL_PROMPT, _RL_NEW = 8, 29, 16


def _rl_steps(tiny_dir: str, tmp: str) -> list[dict]:
    """The PPO update of the project's default algorithm (``PPOActor.ppo_update``: the engine packs the
    rows, runs the shared prompts once, projects the loss positions, computes the loss and its statistics,
    and steps AdamW) on the fsdp engine at d1, one thread, for each width and row count: the best of 3
    after a warm-up. Each point carries the FLOPs that :func:`planner.timing.step_flops` counts for it, so
    the profile's ``train_mfu_points`` are the rates the planner's own accounting needs (:func:`_profile`)."""
    import dataclasses

    from areal_cli.algorithms.actor import PPOActor
    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import AlgoConfig, OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines.fsdp import FSDPEngine
    from areal_cli.models.tiny import make_tiny_model
    from areal_cli.planner.timing import step_flops

    wide_dir = make_tiny_model(os.path.join(tmp, "wide"), tokenizer_dir=tiny_dir, **_RL_WIDE)
    algo = dataclasses.replace(AlgoConfig(), kl_coef=0.0)  # the reference forward is a pass of its own
    out = []
    for model_dir in (tiny_dir, wide_dir):
        engine = FSDPEngine(EngineConfig(max_tokens_per_mb=1 << 20), OptimConfig(lr=1e-6), total_steps=100)
        engine.initialize(ParallelStrategy(), model_dir)
        actor = PPOActor(algo, engine, group_size=_RL_GROUP, max_new_tokens=_RL_NEW)
        hf = engine.model.config
        facts = ModelFacts(hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers, hf.hidden_size,
                           hf.hidden_size // hf.num_attention_heads, hf.intermediate_size, hf.vocab_size, 0, 0,
                           bool(hf.tie_word_embeddings))
        for rows in _RL_ROWS[hf.hidden_size]:
            batch = _rl_batch(rows, hf.vocab_size)
            batch = actor.compute_advantages(batch)
            actor.ppo_update(batch)
            t = min(_timed(lambda: actor.ppo_update(batch)) for _ in range(3))
            seq = _RL_PROMPT + _RL_NEW
            tokens = rows // _RL_GROUP * _RL_PROMPT + rows * _RL_NEW
            out.append({"hidden": hf.hidden_size, "rows": rows, "mb_tokens": tokens, "seconds": t,
                        "flops": step_flops(facts, tokens, rows * _RL_NEW, seq, 1.0, 0.0)})
        engine.destroy()
    return out


def _rl_batch(rows: int, vocab: int) -> dict:
    """``rows`` samples in groups of :data:`_RL_GROUP`: one prompt per group, random responses."""
    import torch

    g = torch.Generator().manual_seed(0)
    seq = _RL_PROMPT + _RL_NEW
    ids = torch.randint(10, vocab - 10, (rows, seq), generator=g)
    ids[:, :_RL_PROMPT] = ids[::_RL_GROUP, :_RL_PROMPT].repeat_interleave(_RL_GROUP, 0)
    mask = torch.zeros(rows, seq)
    mask[:, _RL_PROMPT:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones(rows, seq, dtype=torch.bool), "loss_mask": mask,
            "logprobs": -torch.rand(rows, seq, generator=g) * mask,
            "rewards": torch.randint(0, 2, (rows,), generator=g).float(),
            "versions": torch.zeros(rows, seq, dtype=torch.long)}


def _rss_gb(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 / GIB if m else None


def _device_memory_gb(cuda: bool) -> float:
    """GPU 0's memory, or the host's RAM, in GiB (the unit of ``allocation.estimate.device_memory_gb``)."""
    if cuda:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GIB
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return 16.0
