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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["d1", "t2", "p2", "d2"], choices=sorted(LAYOUTS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tied", action="store_true", help="tied embeddings (12 layers instead of 8)")
    ap.add_argument("--engines", nargs="+", default=sorted(STATE_BYTES), choices=sorted(STATE_BYTES))
    ap.add_argument("--moe", action="store_true",
                    help="a Qwen3-MoE (8 experts) instead: megatron and archon at d2 and d2e2 (megatron "
                         "with a replicated, not distributed, optimizer, so the expert state per rank shows "
                         "the e sharding alone; archon: the expert state held and what a layer gathers)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
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
