"""Per-rank training-state memory and step time of the Archon, Megatron and DeepSpeed engines' layouts.

    python benchmarks/engine_memory.py                  # ~65M-parameter Qwen2, layouts d1 t2 p2 d2, every engine
    python benchmarks/engine_memory.py --engines deepspeed-z1 deepspeed-z2 deepspeed-z3   # ZeRO stages, d1 d2
    python benchmarks/engine_memory.py --tied           # the same size with tied embeddings
    python benchmarks/engine_memory.py --layouts d1 t2 --steps 4 --engines megatron

For each layout the script starts its ranks (gloo on CPU, one thread each), builds the engine on the
same randomly initialised model, runs ``--steps`` AdamW steps on the same global batch and reports,
on the rank holding the most:

- parameter + gradient + optimizer-state bytes held by that rank (archon: local shards of DTensors,
  measured after the last step, when all three exist; megatron: its parameters, DDP's gradient buffers and
  its optimizers' state, which the distributed optimizer shards over d; deepspeed-zN: every distinct
  storage of the module and the ZeRO optimizer, see ``_deepspeed_state``);
- the median step time (wall clock of ``train_batch``, steps after the first).

Ratios are against each engine's d1 measured in the same run. Targets (issue 15): t2 and p2 at most 0.6x of
d1's memory; (issue 18) ZeRO-3 at d2 at most 0.6x of ZeRO-3 at d1; (issue 17, ``--moe``) expert memory per
rank at d2e2 at most 0.6x of d2. Archon's FSDP shards the experts over d at d2 already, so its held expert
state is the same at d2 and d2e2; what e removes is the layer-by-layer gather of every expert (weights in
forward, weights and unsharded gradients in backward), reported beside it.
Step times on a 2-core machine with a 4-process layout mostly measure process contention;
they are printed for what they are.

``--peak`` (issue 35, item 6) measures instead the peak resident memory of each rank in three phases
(``init``: engine construction + ``initialize``; ``step``: ``--steps`` ``train_batch`` calls, two by default
because the first backward runs before AdamW's moments exist, so only the second shows the steady state; ``export``:
``save(weight_format="hf")``) for a randomly initialised model of Qwen2.5-0.5B's shape, at fsdp d4, archon
d2t2 and t2p2, megatron t2p2 and deepspeed (ZeRO-3) d4, each beside its engine's d1:

    python benchmarks/engine_memory.py --peak --repeat 2 --json peak.json
    python benchmarks/engine_memory.py --peak --engines fsdp --model-dir /tmp/peak_models

It prints one ``peak_rss engine=… dims=… phase=… rank_max_gib=… model_gib=… bound_gib=…`` line per layout
and phase (``nan`` where the phase failed); bounds: init/step model / ranks + 1.5 GiB, export the layout's
step peak + 1.0 GiB. The table adds a state bound for the step: (weights + gradients + two AdamW moments) /
ranks + 1.5 GiB, the least an fp32 AdamW step holds. ``--malloc both`` runs every layout also with glibc's
own mmap threshold (labelled ``+glibc``), interleaved, to show what ``utils/host_memory.py`` saves. A layout that fails, or whose ranks go over ``--mem-cap-gib`` together, is reported
as a FAILED row with its reason and the run goes on.
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

LAYOUTS = {"d1": {}, "t2": {"tp": 2}, "p2": {"pp": 2}, "d2": {"dp": 2}, "t2p2": {"tp": 2, "pp": 2},
           "d2e2": {"dp": 2, "ep": 2}}


def make_model(out: str, tied: bool) -> int:
    """A ~65M-parameter Qwen2 with random weights; returns its parameter count. Untied (the default,
    as in Qwen2.5-7B and larger): 8 layers; tied: 12 layers (even, as megatron's p2 needs). Under pipelining
    a tied model keeps a vocab × hidden matrix on both end stages (the embedding and the head's copy of it), so its p2
    share cannot fall much below (V·h + layers/2) / total."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=2048,
                      num_hidden_layers=12 if tied else 8, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=1024, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def make_moe_model(out: str) -> int:
    """A Qwen3-MoE of the same width (8 experts, top-2, every layer MoE) for the expert-parallel rows."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=2048, moe_intermediate_size=512,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _archon_state(engine, run_step) -> dict:
    import torch

    params = list(engine.model.parameters())
    # MoE: the expert weights a layer materialises while it runs beyond the rank's own shards (FSDP's
    # all-gathered copies; under e the local experts are the shard itself), largest layer
    extra = [0]
    hooks = []
    for block in getattr(engine, "moe", []):
        own = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
               for p in (block.experts.gate_up_proj, block.experts.down_proj)}

        def seen(mod, args, own=own):
            from areal_cli.engines.archon.expert_parallel import _local

            ts = [_local(mod.gate_up_proj), _local(mod.down_proj)]
            extra[0] = max(extra[0], sum(_bytes(t) for t in ts if t.untyped_storage().data_ptr() not in own))
        hooks.append(block.experts.register_forward_pre_hook(seen))
    # train_batch frees gradients after its step: one more forward/backward, to count them held.
    run_step()
    for h in hooks:
        h.remove()
    state = {id(p): st for p, st in engine.optimizer.state.items()}
    mem = {"params": sum(_bytes(p) for p in params),
           "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
           "optim": sum(_bytes(v) for st in engine.optimizer.state.values() for v in st.values()
                        if torch.is_tensor(v) and v.dim() > 0)}
    if getattr(engine, "moe", None):
        experts = [p for n, p in engine.model.named_parameters() if ".experts." in n]
        mem["experts"] = sum(_bytes(p) + (_bytes(p.grad) if p.grad is not None else 0)
                             + sum(_bytes(v) for v in state.get(id(p), {}).values()
                                   if torch.is_tensor(v) and v.dim())
                             for p in experts)
        # in backward the layer also holds the unsharded gradient of what it gathered, as large again
        mem["experts_gathered"] = 2 * extra[0]
    engine.optimizer.zero_grad(set_to_none=True)
    return mem


def _megatron_state(engine, run_step) -> dict:
    """Parameters, DDP's persistent gradient buffers, and the optimizers' state (plus fp32 master copies
    when they are not the parameters themselves: bf16 training)."""
    import torch

    params = [p for c in engine.chunks for p in c.parameters()]
    ids = {p.untyped_storage().data_ptr() for p in params}
    optim = 0
    for inner in engine._inner_optimizers():
        optim += sum(_bytes(v) for st in inner.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        optim += sum(_bytes(p) for g in inner.param_groups for p in g["params"]
                     if p.untyped_storage().data_ptr() not in ids)
    grads = sum(_bytes(b.grad_data) for m in engine.model for b in m.buffers)
    grads += sum(_bytes(b.grad_data) for m in engine.model for b in getattr(m, "expert_parallel_buffers", []))
    mem = {"params": sum(_bytes(p) for p in params), "grads": grads, "optim": optim}
    if not engine.cfg.megatron.use_distributed_optimizer:  # optimizer state keyed by the parameters themselves
        experts = [p for c in engine.chunks for n, p in c.named_parameters() if ".experts." in n]
        state = {id(p): st for inner in engine._inner_optimizers() for p, st in inner.state.items()}
        mem["experts"] = sum(_bytes(p) + _bytes(p.main_grad) + sum(_bytes(v) for v in state.get(id(p), {}).values()
                                                                    if torch.is_tensor(v) and v.dim() > 0)
                             for p in experts)
    return mem


def _deepspeed_state(engine, run_step) -> dict:
    """Every distinct storage the rank holds, counted once: the module's parameters (under ZeRO-3 the
    partition ``ds_tensor`` and whatever is gathered or persisted), gradients (``.grad`` and the ZeRO
    optimizer's gradient partitions and buckets), and the rest of the ZeRO optimizer (fp32 partitions,
    Adam's moments over them). Taken after the backward of the boundary micro-batch, before the step."""
    import torch

    seen: set[int] = set()

    def size(t) -> int:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    def walk(obj, depth: int = 0):
        if torch.is_tensor(obj):
            yield obj
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for x in obj:
                yield from walk(x, depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for x in obj.values():
                yield from walk(x, depth + 1)

    run_step()  # forward/backward of every micro-batch; the last is the boundary, so gradients are reduced
    opt = engine.ds.optimizer
    params = list(engine.ds.module.parameters())
    mem = {"params": sum(size(p.data) + (size(p.ds_tensor) if hasattr(p, "ds_tensor") else 0)
                         for p in params)}
    grads = sum(size(p.grad) for p in params if p.grad is not None)
    grads += sum(size(t) for k, v in vars(opt).items() if "grad" in k.lower() for t in walk(v))
    optim = sum(size(t) for st in opt.optimizer.state.values() for t in walk(st))
    optim += sum(size(p) for g in opt.optimizer.param_groups for p in g["params"])
    grads += sum(size(p.grad) for g in opt.optimizer.param_groups for p in g["params"] if p.grad is not None)
    optim += sum(size(t) for k, v in vars(opt).items() if "grad" not in k.lower() for t in walk(v))
    mem.update(grads=grads, optim=optim)
    return mem


STATE_BYTES = {"archon": _archon_state, "megatron": _megatron_state, "deepspeed-z1": _deepspeed_state,
               "deepspeed-z2": _deepspeed_state, "deepspeed-z3": _deepspeed_state}
# DeepSpeed runs data parallelism only: its rows are d1 and d2, for each ZeRO stage.
ENGINE_LAYOUTS = {"deepspeed-z1": ("d1", "d2"), "deepspeed-z2": ("d1", "d2"), "deepspeed-z3": ("d1", "d2")}


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.engines.packing import split_batch_for_dp
    from areal_cli.utils.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo")
    name, _, zero = spec["engine"].partition("-z")  # deepspeed-z3: the deepspeed engine at ZeRO-3
    ecfg = EngineConfig(max_tokens_per_mb=spec["mb_tokens"])
    if zero:
        from areal_cli.config.engine import DeepSpeedConfig

        ecfg.deepspeed = DeepSpeedConfig(zero_stage=int(zero))
    if spec.get("moe"):  # the expert rows compare e against d with a replicated optimizer (see --moe)
        from areal_cli.config.engine import MegatronConfig

        ecfg.megatron = MegatronConfig(use_distributed_optimizer=False)
    engine = get_engine_cls(name)(ecfg, OptimConfig(lr=1e-4), total_steps=spec["steps"], seed=0)
    engine.initialize(ParallelStrategy(**spec["parallel"]), spec["model"])
    g = torch.Generator().manual_seed(0)
    B, L = spec["rows"], spec["seq"]
    batch = {"input_ids": torch.randint(1, 32000, (B, L), generator=g),
             "attention_mask": torch.ones(B, L, dtype=torch.bool), "loss_mask": torch.ones(B, L)}
    batch["loss_mask"][:, : L // 2] = 0
    adv = torch.randn(B, L, generator=g)

    def loss_fn(out, mb):
        m = mb["loss_mask"]
        return -(out["logprobs"] * mb["adv"] * m).sum() / m.sum().clamp(min=1), {}

    batch["adv"] = adv
    local = split_batch_for_dp(batch, engine.dp_world_size)[engine.dp_rank]
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        engine.train_batch(local if engine.is_dp_head else None, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
        times.append(time.perf_counter() - t0)
    mem = STATE_BYTES[spec["engine"]](engine, lambda: engine._accumulate_grads(
        local if engine.is_dp_head else None, loss_fn, lambda mb: float(mb["loss_mask"].sum()), 1.0))
    mem["total"] = mem["params"] + mem["grads"] + mem["optim"]
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, mem)
    if dist.get_rank() == 0:
        worst = max(box, key=lambda m: m["total"])
        with open(spec["out"], "w") as f:
            json.dump({"mem": worst, "per_rank": [m["total"] for m in box],
                       "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0]}, f)
    dist.barrier()
    engine.destroy()


def run_layout(engine: str, name: str, model: str, args, tmp: str) -> dict:
    from areal_cli.utils.network import find_free_port

    parallel = LAYOUTS[name]
    world = 1
    for k, v in parallel.items():
        world *= v if k in ("dp", "tp", "pp", "cp") else 1  # e borrows from d: no processes of its own
    out = os.path.join(tmp, f"{engine}_{name}.json")
    spec = {"engine": engine, "moe": bool(getattr(args, "moe", False)), "parallel": parallel, "model": model, "steps": args.steps, "rows": args.rows, "seq": args.seq,
            "mb_tokens": args.rows * args.seq // 4, "out": out}
    port = find_free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=1800)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{engine} layout {name} failed:\n" + "\n".join(e[-3000:] for e in errs))
    with open(out) as f:
        return json.load(f)


# ---- --peak: peak RSS per rank and phase (issue 35, item 6) ----

# Qwen2.5-0.5B's shape (random weights): 494M parameters with tied embeddings, ~1.84 GiB in fp32.
QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-6}
# Each engine's sharded layouts; its d1 runs beside them (the ratio's denominator).
PEAK_LAYOUTS = {"fsdp": ("d4",), "archon": ("d2t2", "t2p2"), "megatron": ("t2p2",), "deepspeed": ("d4",)}
PHASES = ("init", "step", "export")
_DIM_KEYS = {"d": "dp", "t": "tp", "p": "pp", "c": "cp", "e": "ep"}


def parse_dims(dims: str) -> dict:
    import re

    parts = re.findall(r"([dtpce])(\d+)", dims)
    if not parts or "".join(a + b for a, b in parts) != dims:
        raise SystemExit(f"cannot read the layout {dims!r}: use letters d t p c e with sizes, e.g. d2t2")
    return {_DIM_KEYS[a]: int(b) for a, b in parts if int(b) > 1}


def world_of(parallel: dict) -> int:
    n = 1
    for k, v in parallel.items():
        n *= v if k in ("dp", "tp", "pp", "cp") else 1  # e borrows from d: no processes of its own
    return n


def make_peak_model(out: str, vocab: int) -> None:
    """Build the model into ``out`` (fp32 safetensors); ``peak_model.json`` is written last, so a build
    that died half way is not taken for a cached model."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=vocab, **QWEN25_05B)).float()
    part = out + ".part"
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part, safe_serialization=True)
    # tied: the head is the embedding, stored and counted once (as save_pretrained does)
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(part, "peak_model.json"), "w") as f:
        json.dump({"params": n, "vocab": vocab, "bytes_fp32": 4 * n}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(part, out)


def peak_model(args, tmp: str) -> tuple[str, dict]:
    """The model dir, built in a child process (so this parent never holds the 2 GiB model while the
    ranks run) or reused from ``--model-dir``."""
    path = os.path.join(args.model_dir or tmp, f"qwen2.5-0.5b-shape-v{args.vocab}")
    meta = os.path.join(path, "peak_model.json")
    if not os.path.exists(meta):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--make-peak-model", path, "--vocab", str(args.vocab)],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        print(f"built {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(meta) as f:
        return path, json.load(f)


def peak_worker(spec: dict) -> None:
    """One rank: baseline RSS, then the peak of each phase; its figures go to its own file after every
    phase, so a rank that dies in a later phase still leaves the earlier ones."""
    import torch

    from _rss import GIB, PeakMeter, rss_bytes

    torch.set_num_threads(1)
    meter = PeakMeter()
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import DeepSpeedConfig, EngineConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.engines.packing import split_batch_for_dp
    from areal_cli.utils.dist import init_distributed

    cls = get_engine_cls(spec["engine"])  # imports the engine's module (deepspeed, megatron-core) now
    init_distributed("gloo")
    rank = dist.get_rank()
    rec = {"rank": rank, "method": meter.method, "phases": {}}
    out = os.path.join(spec["out"], f"rank{rank}.json")

    def dump() -> None:
        with open(out + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(out + ".tmp", out)

    dist.barrier()
    rec["baseline_gib"] = rss_bytes() / GIB
    dump()
    meter.start()
    ecfg = EngineConfig(name=spec["engine"], max_tokens_per_mb=spec["mb_tokens"])
    if spec.get("grad_reduce"):  # --grad-reduce (FSDP2 engines only: the others refuse a non-default value)
        ecfg.grad_reduce = spec["grad_reduce"]
    if spec.get("tied_head"):  # --tied-head (engine=fsdp: its row-sharded tied table, or FSDP2's gathered unit)
        ecfg.tied_head = spec["tied_head"]
    if spec["engine"] == "deepspeed":
        ecfg.deepspeed = DeepSpeedConfig(zero_stage=3)
        if spec.get("ds_bucket_mel"):  # --ds-bucket-mel
            ecfg.deepspeed.bucket_mel = spec["ds_bucket_mel"]
    engine = cls(ecfg, OptimConfig(lr=1e-4), total_steps=spec["steps"], seed=0)
    engine.initialize(ParallelStrategy(**spec["parallel"]), spec["model"])
    rec["phases"]["init"] = meter.stop()
    dump()
    g = torch.Generator().manual_seed(0)
    B, L = spec["rows"], spec["seq"]
    batch = {"input_ids": torch.randint(1, spec["vocab"], (B, L), generator=g),
             "attention_mask": torch.ones(B, L, dtype=torch.bool), "loss_mask": torch.ones(B, L),
             "adv": torch.randn(B, L, generator=g)}
    batch["loss_mask"][:, : L // 2] = 0  # half prompt

    def loss_fn(o, mb):
        m = mb["loss_mask"]
        return -(o["logprobs"] * mb["adv"] * m).sum() / m.sum().clamp(min=1), {}

    local = split_batch_for_dp(batch, engine.dp_world_size)[engine.dp_rank]
    dist.barrier()
    meter.start()
    for _ in range(spec["steps"]):
        engine.train_batch(local if engine.is_dp_head else None, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
    rec["phases"]["step"] = meter.stop()
    dump()
    dist.barrier()
    meter.start()
    engine.save(SaveLoadMeta(path=spec["export"], weight_format="hf"))
    rec["phases"]["export"] = meter.stop()
    dump()
    meter.close()
    engine.destroy()


def _watch(procs: list, args) -> tuple[str | None, float]:
    """Wait for the ranks; kill them (each its own session, by pid) when their private memory together
    passes ``--mem-cap-gib``, the machine's MemAvailable falls under ``--min-avail-gib`` (other jobs share
    it), a rank has failed and the rest have not followed within 30 s (stuck in a collective), or the
    layout runs past ``--layout-timeout``. Returns the kill reason (None: they all exited) and the peak."""
    import signal

    from _rss import GIB, mem_available_bytes, tree_private_bytes

    t0, failed_at, peak, reason = time.monotonic(), None, 0, None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        priv = tree_private_bytes([p.pid for p in procs])
        peak = max(peak, priv)
        avail = mem_available_bytes()
        now = time.monotonic()
        if priv > args.mem_cap_gib * GIB:
            reason = f"killed: the ranks' private RSS reached {priv / GIB:.1f} GiB (> --mem-cap-gib {args.mem_cap_gib})"
        elif avail < args.min_avail_gib * GIB:
            reason = (f"killed: machine MemAvailable fell to {avail / GIB:.1f} GiB (< --min-avail-gib "
                      f"{args.min_avail_gib}) with the ranks at {priv / GIB:.1f} GiB")
        elif now - t0 > args.layout_timeout:
            reason = f"killed: still running after --layout-timeout {args.layout_timeout} s"
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if reason or (failed_at is not None and now - failed_at > 30):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                p.wait()
            break
        time.sleep(0.25)
    return reason, peak / GIB


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def run_peak_layout(engine: str, label: str, model: str, info: dict, args, tmp: str) -> dict:
    """One layout's ranks, start to end; never raises for the ranks' failures (the row says FAILED).
    ``label``: the dims, ``+glibc`` for a run with glibc's own mmap threshold (``--malloc``)."""
    import shutil

    from areal_cli.utils.network import find_free_port

    dims, _, variant = label.partition("+")
    parallel = parse_dims(dims)
    world = world_of(parallel)
    run_dir = tempfile.mkdtemp(dir=tmp, prefix=f"{engine}_{dims}{variant}_")
    spec = {"engine": engine, "parallel": parallel, "model": model, "vocab": info["vocab"], "steps": args.steps,
            "rows": args.rows, "seq": args.seq, "mb_tokens": args.mb_tokens, "grad_reduce": args.grad_reduce,
            "tied_head": args.tied_head, "ds_bucket_mel": args.ds_bucket_mel,
            "out": run_dir,
            "export": os.path.join(run_dir, "export")}
    port = find_free_port()
    procs, errs = [], []
    t0 = time.perf_counter()
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        # glibc: the engines' fixed mmap threshold off (utils/host_memory.py), the baseline it is measured against
        env["AREAL_MMAP_THRESHOLD"] = "0" if variant == "glibc" else ""
        errs.append(os.path.join(run_dir, f"stderr{r}.txt"))
        with open(errs[-1], "w") as err:  # a file, not a pipe: nothing blocks on a full pipe while we poll
            procs.append(subprocess.Popen([sys.executable, __file__, "--peak-worker", json.dumps(spec)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    reason, tree_peak = _watch(procs, args)
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(world):
        try:
            with open(os.path.join(run_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append(None)
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if reason is None and bad:
        r, code = bad[0]
        reason = (f"rank {r} killed by signal {-code}" + (" (the kernel's OOM killer?)" if code == -9 else "")
                  if code < 0 else f"rank {r} exited with {code}")
    tails = {r: _tail(errs[r]) for r, _ in (bad or ([(0, 0)] if reason else []))}
    shutil.rmtree(run_dir, ignore_errors=True)  # the export is a full model copy
    return {"engine": engine, "dims": label, "world": world, "ok": reason is None, "reason": reason,
            "wall_s": wall, "tree_private_peak_gib": tree_peak, "ranks": ranks, "stderr_tail": tails}


def _phase_figures(run: dict, phase: str) -> list[float] | None:
    """Per-rank peaks of the phase, or None unless every rank finished it."""
    got = [r["phases"][phase]["peak"] for r in run["ranks"] if r and phase in r["phases"]]
    return got if len(got) == run["world"] else None


def summarize_peak(runs: list[dict], model_gib: float) -> dict:
    """(engine, dims) -> phase -> medians over the repeats, every repeat's rank-max, per-rank medians,
    the bound and the failure reasons of the repeats that did not finish the phase."""
    keys = list(dict.fromkeys((r["engine"], r["dims"]) for r in runs))
    summ: dict = {}
    for key in keys:
        mine = [r for r in runs if (r["engine"], r["dims"]) == key]
        world = mine[0]["world"]
        summ[key] = {}
        for phase in PHASES:
            figs = [(r, _phase_figures(r, phase)) for r in mine]
            done = [f for _, f in figs if f is not None]
            fails = [r["reason"] or "?" for r, f in figs if f is None]
            maxes = [max(f) for f in done]
            # anonymous memory alone (sampled): what was copied, not merely mapped from the safetensors file
            anon = [max(x["phases"][phase]["anon_sampled"] for x in r["ranks"]) for r, f in figs if f is not None]
            summ[key][phase] = {
                "rank_max": statistics.median(maxes) if maxes else float("nan"), "values": maxes,
                "per_rank": [statistics.median(f[i] for f in done) for i in range(world)] if done else [],
                "anon_max": statistics.median(anon) if anon else float("nan"), "fails": fails, "world": world}
        for phase in PHASES:
            s = summ[key][phase]
            s["bound"] = (summ[key]["step"]["rank_max"] + 1.0 if phase == "export"
                          else model_gib / world + 1.5)  # world = the ranks sharding the weights here
            s["met"] = s["rank_max"] <= s["bound"]  # False for nan
            # what an fp32 AdamW step holds at least: weights, gradients and two moments, sharded the same way
            s["state_bound"] = 4 * model_gib / world + 1.5 if phase == "step" else s["bound"]
            s["state_met"] = s["rank_max"] <= s["state_bound"]
    return summ


def report_peak(runs: list[dict], summ: dict, info: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    model_gib = info["bytes_fp32"] / 1024 ** 3
    console = Console(width=200)
    table = Table(title=f"Peak RSS per rank, random Qwen2.5-0.5B shape ({info['params'] / 1e6:.0f}M params, vocab "
                        f"{info['vocab']}), fp32 + AdamW, {args.rows}x{args.seq} tokens, {args.steps} step(s), "
                        f"{args.repeat} repeat(s), max_tokens_per_mb {args.mb_tokens}"
                        + (f", grad_reduce {args.grad_reduce}" if args.grad_reduce else ""))
    for col in ("engine", "dims", "phase", "rank-max peak GiB", "per-rank peaks GiB", "model GiB", "d1 peak GiB",
                "vs d1", "bound GiB", "met?", "state bound GiB", "met?", "anon GiB"):
        table.add_column(col, justify="right" if "GiB" in col or col == "vs d1" else "left")
    for (e, dims), phases in summ.items():
        for phase in PHASES:
            s = phases[phase]
            variant = dims.partition("+")[1:]
            base = summ.get((e, "d1" + "".join(variant)), {}).get(phase, {}).get("rank_max", float("nan"))
            if s["values"]:
                peak = f"{s['rank_max']:.2f}" + (f" ({', '.join(f'{v:.2f}' for v in s['values'])})"
                                                 if args.repeat > 1 else "")
                if s["fails"]:
                    peak += f" [{len(s['fails'])} FAILED]"
            else:
                peak = f"FAILED: {s['fails'][0][:70]}"
            table.add_row(e, dims, phase, peak, " ".join(f"{v:.2f}" for v in s["per_rank"]), f"{model_gib:.2f}",
                          f"{base:.2f}", f"{s['rank_max'] / base:.2f}x", f"{s['bound']:.2f}",
                          "met" if s["met"] else ("FAILED" if not s["values"] else "NOT met"),
                          f"{s['state_bound']:.2f}", "met" if s["state_met"] else "NOT met", f"{s['anon_max']:.2f}")
    console.print(table)
    print("state bound: step at most (weights + gradients + two AdamW moments) / ranks + 1.5 GiB, what an fp32 "
          "AdamW step holds before any activation (4 x model / ranks); init and export as the bound")
    glibc = [(k, v) for k, v in summ.items() if k[1].endswith("+glibc") and (k[0], k[1][:-6]) in summ]
    for (e, label), ph in glibc:
        mine = summ[(e, label[:-6])]
        print(f"host_memory vs glibc's default threshold, {e} {label[:-6]}: " + ", ".join(
            f"{p} {mine[p]['rank_max']:.2f} vs {ph[p]['rank_max']:.2f} GiB ({mine[p]['rank_max'] / ph[p]['rank_max']:.2f}x)"
            for p in PHASES))
    print("anon GiB: rank-max of the sampled peak of anonymous memory alone (weights still mapped from the "
          "safetensors file count in RSS only once touched, and are reclaimable)")
    times = Table(title="Wall time per layout run (s) and rank 0's phase times (median over repeats)")
    for col in ("engine", "dims", "ranks", "run wall s", "init s", "step s", "export s", "baseline GiB (rank max)",
                "ranks' private RSS peak GiB"):
        times.add_column(col, justify="left" if col in ("engine", "dims") else "right")
    for (e, dims) in summ:
        mine = [r for r in runs if (r["engine"], r["dims"]) == (e, dims)]

        def med(phase: str, mine=mine) -> str:
            v = [r["ranks"][0]["phases"][phase]["wall_s"] for r in mine
                 if r["ranks"][0] and phase in r["ranks"][0]["phases"]]
            return f"{statistics.median(v):.1f}" if v else "-"
        base = [max(x["baseline_gib"] for x in r["ranks"] if x) for r in mine if any(r["ranks"])]
        times.add_row(e, dims, str(mine[0]["world"]), " ".join(f"{r['wall_s']:.0f}" for r in mine), med("init"),
                      med("step"), med("export"), " ".join(f"{b:.2f}" for b in base),
                      " ".join(f"{r['tree_private_peak_gib']:.1f}" for r in mine))
    console.print(times)
    methods = sorted({x["method"] for r in runs for x in r["ranks"] if x})
    print(f"RSS method in the ranks: {', '.join(methods) or '?'} (hwm: VmHWM reset through /proc/self/clear_refs; "
          f"sampled: VmRSS every 5 ms)")
    gaps = [x["phases"][p]["hwm"] - x["phases"][p]["sampled"] for r in runs for x in r["ranks"] if x
            for p in x["phases"] if x["phases"][p]["hwm"] is not None]
    if gaps:
        print(f"VmHWM minus the 5 ms sampled peak, over {len(gaps)} rank-phases: min {min(gaps):.3f}, "
              f"median {statistics.median(gaps):.3f}, max {max(gaps):.3f} GiB")
    for r in runs:
        if not r["ok"]:
            print(f"\nFAILED {r['engine']} {r['dims']} ({r['wall_s']:.0f} s): {r['reason']}")
            for rank, tail in r["stderr_tail"].items():
                lines = [ln for ln in tail.splitlines() if ln.strip()][-15:]
                print(f"  rank {rank} stderr tail:\n    " + "\n    ".join(lines))
    print()
    for (e, dims), phases in summ.items():
        for phase in PHASES:
            s = phases[phase]
            print(f"peak_rss engine={e} dims={dims} phase={phase} rank_max_gib={s['rank_max']:.3f} "
                  f"model_gib={model_gib:.3f} bound_gib={s['bound']:.3f}")


def main_peak(args) -> None:
    engines = args.engines or list(PEAK_LAYOUTS)
    bad = [e for e in engines if e not in PEAK_LAYOUTS]
    if bad:
        raise SystemExit(f"--peak engines are {', '.join(PEAK_LAYOUTS)}; not {', '.join(bad)}")
    order = []
    for e in engines:
        dims = ([] if args.no_d1 else ["d1"]) + [d for d in PEAK_LAYOUTS[e] if d != "d1"]
        order += [(e, d) for d in dims if args.layouts is None or d == "d1" or d in args.layouts]
    if not order:
        raise SystemExit("no layout left after --engines/--layouts")
    runs = []
    with tempfile.TemporaryDirectory(prefix="peak_rss_") as tmp:
        model, info = peak_model(args, tmp)
        suffixes = {"areal": [""], "glibc": ["+glibc"], "both": ["", "+glibc"]}[args.malloc]
        for rnd in range(args.repeat):  # interleaved: slow drift of the machine spreads over every layout
            for e, dims in [(e, d + x) for e, d in order for x in suffixes]:
                r = run_peak_layout(e, dims, model, info, args, tmp)
                r["round"] = rnd
                runs.append(r)
                status = "ok" if r["ok"] else f"FAILED: {r['reason']}"
                print(f"[round {rnd + 1}/{args.repeat}] {e} {dims}: {r['wall_s']:.0f} s, {status}", flush=True)
    summ = summarize_peak(runs, info["bytes_fp32"] / 1024 ** 3)
    report_peak(runs, summ, info, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": info, "args": vars(args), "runs": runs,
                       "summary": [{"engine": e, "dims": d, "phase": p, **s} for (e, d), ph in summ.items()
                                   for p, s in ph.items()]}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # --layouts/--engines/--steps/--rows default per mode (the --peak mode's names differ)
    ap.add_argument("--layouts", nargs="+", default=None,
                    help=f"default: d1 t2 p2 d2 (of {' '.join(LAYOUTS)}); --peak: every sharded layout "
                         "(d4 d2t2 t2p2), each engine's d1 always beside them")
    ap.add_argument("--steps", type=int, default=None, help="train_batch calls (default 3; --peak: 2)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the global batch (default 8; --peak: 4)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tied", action="store_true", help="tied embeddings (12 layers instead of 8)")
    ap.add_argument("--engines", nargs="+", default=None,
                    help=f"default: {' '.join(sorted(STATE_BYTES))}; --peak: {' '.join(PEAK_LAYOUTS)}")
    ap.add_argument("--peak", action="store_true", help="peak RSS per rank of init, step and HF export, "
                    "Qwen2.5-0.5B-shaped model (see the module doc)")
    ap.add_argument("--vocab", type=int, default=151936, help="--peak: vocabulary size (Qwen2.5's by default)")
    ap.add_argument("--model-dir", default=None, help="--peak: keep the built model here and reuse it")
    ap.add_argument("--mb-tokens", type=int, default=256, help="--peak: max_tokens_per_mb")
    ap.add_argument("--repeat", type=int, default=1, help="--peak: runs of each layout, interleaved")
    ap.add_argument("--grad-reduce", default=None, choices=("per_micro_batch", "last_micro_batch"),
                    help="--peak: engine.grad_reduce for the ranks (fsdp/archon; default: the engine's, "
                         "per_micro_batch)")
    ap.add_argument("--tied-head", default=None, choices=("auto", "sharded", "gathered"),
                    help="--peak: engine.tied_head for fsdp and deepspeed (default auto: row-sharded at these sizes)")
    ap.add_argument("--ds-bucket-mel", type=float, default=None,
                    help="--peak: engine.deepspeed.bucket_mel (default: the engine's)")
    ap.add_argument("--malloc", default="areal", choices=("areal", "glibc", "both"),
                    help="--peak: the ranks' host allocator threshold: the engines' fixed one "
                         "(utils/host_memory.py), glibc's dynamic default (layouts labelled +glibc), or both, "
                         "interleaved")
    ap.add_argument("--json", default=None, help="--peak: write every raw figure here")
    ap.add_argument("--no-d1", action="store_true", help="--peak: skip the d1 runs")
    ap.add_argument("--mem-cap-gib", type=float, default=19.0,
                    help="--peak: kill a layout whose ranks' private RSS together passes this")
    ap.add_argument("--min-avail-gib", type=float, default=1.5,
                    help="--peak: kill a layout when the machine's MemAvailable falls below this")
    ap.add_argument("--layout-timeout", type=float, default=1800, help="--peak: seconds per layout run")
    ap.add_argument("--peak-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--make-peak-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--moe", action="store_true",
                    help="a Qwen3-MoE (8 experts) instead: megatron and archon at d2 and d2e2 (megatron "
                         "with a replicated, not distributed, optimizer, so the expert state per rank shows "
                         "the e sharding alone; archon: the expert state held and what a layer gathers)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.peak_worker:
        peak_worker(json.loads(args.peak_worker))
        return
    if args.make_peak_model:
        make_peak_model(args.make_peak_model, args.vocab)
        return
    if args.peak:
        args.steps, args.rows = args.steps or 2, args.rows or 4
        main_peak(args)
        return
    args.steps, args.rows = args.steps or 3, args.rows or 8
    args.engines = args.engines or sorted(STATE_BYTES)
    args.layouts = args.layouts or ["d1", "t2", "p2", "d2"]
    for flag, given, known in (("--engines", args.engines, STATE_BYTES), ("--layouts", args.layouts, LAYOUTS)):
        if any(x not in known for x in given):
            ap.error(f"{flag}: choose from {', '.join(sorted(known))}")
    from rich.console import Console
    from rich.table import Table

    if args.moe:
        args.engines = [e for e in args.engines if e in ("megatron", "archon")] or ["megatron", "archon"]
        args.layouts = ["d2", "d2e2"]
    layouts = ["d1"] + [x for x in args.layouts if x != "d1"]
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        n = make_moe_model(model) if args.moe else make_model(model, args.tied)
        res = {(e, name): run_layout(e, name, model, args, tmp) for e in args.engines for name in layouts
               if name in ENGINE_LAYOUTS.get(e, LAYOUTS)}
    kind = "Qwen3-MoE" if args.moe else f"Qwen2 ({'tied' if args.tied else 'untied'})"
    table = Table(title=f"Per-rank training state, {n / 1e6:.1f}M-parameter {kind}, fp32 + Adam")
    for col in ("engine", "layout", "params MB", "grads MB", "optim MB", "total MB", "vs d1", "step s",
                "step vs d1"):
        table.add_column(col, justify="right")
    mb = 1024 ** 2
    for (e, name), r in res.items():
        base, m = res[(e, "d1")], r["mem"]
        table.add_row(e, name, f"{m['params'] / mb:.1f}", f"{m['grads'] / mb:.1f}", f"{m['optim'] / mb:.1f}",
                      f"{m['total'] / mb:.1f}", f"{m['total'] / base['mem']['total']:.2f}x", f"{r['step_s']:.2f}",
                      f"{r['step_s'] / base['step_s']:.2f}x")
    Console().print(table)
    if args.moe:
        mb_ = 1024 ** 2
        if ("megatron", "d2") in res:
            d2, e2 = res[("megatron", "d2")]["mem"]["experts"], res[("megatron", "d2e2")]["mem"]["experts"]
            print(f"megatron expert state per rank: d2 {d2 / mb_:.1f} MB, d2e2 {e2 / mb_:.1f} MB = "
                  f"{e2 / d2:.2f}x of d2 (target <= 0.6x): {'met' if e2 <= 0.6 * d2 else 'NOT met'}")
        if ("archon", "d2") in res:
            a, b = res[("archon", "d2")]["mem"], res[("archon", "d2e2")]["mem"]
            print(f"archon expert state held per rank (FSDP shards it over d either way): "
                  f"d2 {a['experts'] / mb_:.1f} MB, d2e2 {b['experts'] / mb_:.1f} MB = "
                  f"{b['experts'] / a['experts']:.2f}x")
            ga, gb = a["experts_gathered"], b["experts_gathered"]
            print(f"archon expert weights + grads one layer materialises beyond its shards: "
                  f"d2 {ga / mb_:.1f} MB, d2e2 {gb / mb_:.1f} MB")
            pa, pb = a["experts"] + ga, b["experts"] + gb
            print(f"archon expert memory per rank at its peak (held + one layer's gathered): "
                  f"d2 {pa / mb_:.1f} MB, d2e2 {pb / mb_:.1f} MB = {pb / pa:.2f}x of d2 (target <= 0.6x): "
                  f"{'met' if pb <= 0.6 * pa else 'NOT met'}")
        return
    for (e, name), r in res.items():
        if name in ("t2", "p2") or (e == "deepspeed-z3" and name == "d2"):
            ratio = r["mem"]["total"] / res[(e, "d1")]["mem"]["total"]
            print(f"{e} {name}: {ratio:.2f}x of d1 (target <= 0.6x): {'met' if ratio <= 0.6 else 'NOT met'}")


if __name__ == "__main__":
    main()
