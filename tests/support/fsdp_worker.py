"""Worker process for the multi-process FSDP tests (one process per rank, gloo on CPU).

Run as ``python fsdp_worker.py <json spec>`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set
(see :func:`launch`). The spec lists variants; each builds a fresh engine on the same process
group, runs it, and rank 0 saves results to ``<out>/<variant name>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def make_batch(seed: int, B: int = 8, L: int = 24, vocab: int = 300):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, L + 1, (B,), generator=g)
    am = torch.arange(L)[None] < lens[:, None]
    ids = torch.randint(1, vocab, (B, L), generator=g) * am
    lm = am.float()
    lm[:, :4] = 0
    adv = torch.randn(B, L, generator=g)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "advantages": adv}


def make_group_batch(seed: int, L: int = 32, vocab: int = 300):
    """GRPO-shaped rows: groups of 4, 3 and 1 share a prompt (loss 0); completions of random length,
    one with a loss-masked hole (a tool reply), and one row with no loss token at all."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for size in (4, 3, 1):
        p = int(torch.randint(5, 9, (1,), generator=g))
        prompt = torch.randint(1, vocab, (p,), generator=g)
        for _ in range(size):
            c = int(torch.randint(1, L - p + 1, (1,), generator=g))
            ids = torch.cat([prompt, torch.randint(1, vocab, (c,), generator=g)])
            lm = torch.cat([torch.zeros(p), torch.ones(c)])
            rows.append((ids, lm))
    ids, lm = rows[1]
    if lm.numel() > 10:
        lm[-4:-2] = 0
    rows[5] = (rows[5][0], torch.zeros_like(rows[5][1]))
    B = len(rows)
    out_ids = torch.zeros(B, L, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.bool)
    out_lm = torch.zeros(B, L)
    for r, (ids, lm) in enumerate(rows):
        out_ids[r, : ids.numel()] = ids
        am[r, : ids.numel()] = True
        out_lm[r, : ids.numel()] = lm
    return {"input_ids": out_ids, "attention_mask": am, "loss_mask": out_lm, "advantages": torch.randn(B, L, generator=g)}


def engine_config(ekw: dict):
    """``EngineConfig`` from a spec's JSON dict, its nested backend sections made typed."""
    from areal_cli.config.engine import ArchonConfig, DeepSpeedConfig, EngineConfig, MegatronConfig

    ekw = dict(ekw)
    for key, cls in (("archon", ArchonConfig), ("deepspeed", DeepSpeedConfig), ("megatron", MegatronConfig)):
        if key in ekw:
            ekw[key] = cls(**ekw[key])
    return EngineConfig(**ekw)


def local_batch(engine, batch):
    """This rank's share of ``batch`` (``None`` off the DP heads, as the trainer passes it)."""
    from areal_cli.engines.packing import split_batch_for_dp

    if engine.dp_world_size > 1:
        batch = split_batch_for_dp(batch, engine.dp_world_size)[engine.dp_rank]
    return batch if engine.is_dp_head else None


def megatron_grad_probe(engine) -> dict:
    """Hooks on the vocabulary-sized weights of a megatron engine's chunks (engines/megatron/grad_memory.py): how
    often autograd hands the embedding a weight gradient (never: its rows go into ``main_grad``), and whether
    each gradient the output layer's weight receives is the fused path's placeholder (``grad_added_to_main_grad``
    set when it arrives)."""
    seen: dict = {"embedding_grads": 0, "output_grads": [], "stages": []}
    for chunk in engine.chunks:
        if getattr(chunk, "pre_process", False):
            w = chunk.embedding.word_embeddings.weight
            # (autograd calls a leaf's hooks with None when a backward returned no gradient for it)
            w.register_hook(lambda g: seen.__setitem__("embedding_grads", seen["embedding_grads"] + (g is not None)))
            seen["stages"].append("first")
        if getattr(chunk, "post_process", False) and getattr(chunk.output_layer, "weight", None) is not None:
            w = chunk.output_layer.weight
            seen["stages"].append("last")
            w.register_hook(lambda g, w=w: None if g is None else seen["output_grads"].append(
                bool(getattr(w, "grad_added_to_main_grad", False))))
    return seen


def tied_rows_record(engine) -> list:
    """Every rank's split of a pipelined tied table's AdamW state (engines/archon/tied_rows.py), or None:
    which end it is, the rows it owns of its local copy, the rows its moments cover, and whether the main
    optimizer holds the table too. Collective."""
    import torch.distributed as dist

    from areal_cli.utils import collectives

    tr, mine = getattr(engine, "_tied_rows", None), None
    if tr is not None:
        state = tr.opt.state[tr.opt.param_groups[0]["params"][0]] if tr.opt is not None else {}
        local = tr.param.to_local() if hasattr(tr.param, "to_local") else tr.param
        mine = {"first": tr.first, "owned": tr.hi - tr.lo, "local": int(local.shape[0]),
                "moment_rows": int(state["exp_avg"].shape[0]) if "exp_avg" in state else 0,
                "in_main": any(p is tr.param for g in engine.optimizer.param_groups for p in g["params"])}
    out: list = [None] * dist.get_world_size()
    collectives.all_gather_object(out, mine)
    return out


def finish_variant(engine, v: dict, res: dict, out_dir: str) -> None:
    """The variant's optional DCP save and HF export, rank 0's ``<out>/<name>.pt``, then teardown."""
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import SaveLoadMeta

    if v.get("save"):
        engine.save(SaveLoadMeta(path=v["save"], weight_format="dcp"))
    if v.get("export"):
        engine.save(SaveLoadMeta(path=v["export"], weight_format="hf"))
    if dist.get_rank() == 0:
        torch.save(res, Path(out_dir) / f"{v['name']}.pt")
    dist.barrier()
    engine.destroy()


def greedy_probe(client, runner, prompts: list, timeout: float, max_new_tokens: int = 12) -> tuple:
    """The server's greedy completions of ``prompts`` (tokens, per-token versions) and its versions."""
    from areal_cli.api.io_struct import GenerationConfig, ModelRequest

    g = GenerationConfig(greedy=True, max_new_tokens=max_new_tokens)

    async def go():
        outs = [await client.agenerate(ModelRequest(input_ids=p, gconfig=g)) for p in prompts]
        return [o.output_tokens for o in outs], [o.output_versions for o in outs], await client.get_server_versions()

    return runner.run(go(), timeout)


def loss_fn(out, mb):
    m = mb["loss_mask"].float()
    n = m.sum().clamp(min=1)
    pg = -(out["logprobs"] * mb["advantages"] * m).sum() / n
    ent = (out["entropy"] * m).sum() / n
    return pg - 0.01 * ent, {"entropy": float(ent.detach())}


def loss_weight_fn(mb):
    return float(mb["loss_mask"].sum())


def value_loss_fn(out, mb):
    m = mb["loss_mask"].float()
    err = ((out["values"] - mb["advantages"]) ** 2 * m).sum() / m.sum().clamp(min=1)
    return err, {"value_mse": float(err.detach())}


def run_critic(v: dict, model_dir: str, out_dir: str) -> None:
    """Train a critic a few steps, export it, rebuild a critic from the export, compare values."""
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls

    cls = get_engine_cls(v.get("cls", "fsdp"))
    parallel = ParallelStrategy(**v.get("parallel", {}))
    critic = cls(EngineConfig(), OptimConfig(**{"lr": 1e-3, **v.get("optim", {})}), total_steps=5, seed=0,
                 critic=True)
    critic.initialize(parallel, model_dir)
    b = make_batch(0)
    head = critic.is_dp_head
    values_init = critic.forward(b if head else None, output="values")["values"]
    stats = [critic.train_batch(b if head else None, value_loss_fn, loss_weight_fn) for _ in range(5)]
    values = critic.forward(b if head else None, output="values")["values"]
    export = str(Path(out_dir) / f"{v['name']}_hf")
    critic.save(SaveLoadMeta(path=export, weight_format="hf"))
    again = cls(EngineConfig(), None, seed=123, critic=True)
    again.initialize(parallel, export, peers=(critic,))  # megatron: both engines on one parallel state
    values2 = again.forward(b if head else None, output="values")["values"]
    if dist.get_rank() == 0:
        torch.save({"stats": stats, "values": values, "values_reloaded": values2, "batch": b,
                    "values_init": values_init},
                   Path(out_dir) / f"{v['name']}.pt")
    critic.destroy()
    again.destroy()


def full_grads(engine):
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def full_weights(engine):
    return {n: t.clone() for n, t in engine._named_full_tensors() if t is not None}


def attn_record(engine) -> list[str]:
    """Which attention the built model runs: the HF engines' registered attention function, or the class of
    megatron's core-attention modules."""
    if hasattr(engine, "chunks"):
        return sorted({type(m).__name__ for c in engine.chunks for n, m in c.named_modules()
                       if n.endswith("core_attention")})
    return [str(getattr(getattr(engine, "hf_config", None), "_attn_implementation", None))]


def spy_masks(engine, batch) -> list:
    """For each attention kernel call of one ``forward(batch)``: the mask it received (id, storage,
    device), or None. The kernels are wrapped, not replaced: each call goes through to the real one."""
    from areal_cli.engines import attn_kernels

    calls, real = [], dict(attn_kernels.KERNELS)

    def wrap(fn):
        def spy(q, k, v, mask, *a, **kw):
            calls.append(None if mask is None else (id(mask), mask.data_ptr(), str(mask.device)))
            return fn(q, k, v, mask, *a, **kw)
        return spy

    attn_kernels.KERNELS.update({k: wrap(f) for k, f in real.items()})
    try:
        engine.forward(batch if engine.is_dp_head else None)
    finally:
        attn_kernels.KERNELS.update(real)
    return calls


def run_variant(v: dict, model_dir: str, out_dir: str) -> None:
    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.engines import get_engine_cls

    # forward_only: an engine without an optimizer (a reference model's), as the trainer builds it
    ocfg = None if v.get("forward_only") else OptimConfig(**{"lr": 1e-3, "grad_clip": 1e9, **v.get("optim", {})})
    engine = get_engine_cls(v.get("cls", "fsdp"))(engine_config(v.get("engine", {})), ocfg,
                                                  total_steps=v.get("total_steps", 4), seed=0)
    if "batch_p2p_comm" in v:  # megatron's p2p mode, to show that the batched one is still wrong on gloo
        from areal_cli.engines.megatron import model as mcore_model

        mcore_model.BATCH_P2P_COMM = bool(v["batch_p2p_comm"])
    try:
        engine.initialize(ParallelStrategy(**v.get("parallel", {})), model_dir)
    finally:
        if "batch_p2p_comm" in v:
            mcore_model.BATCH_P2P_COMM = False
    res: dict = {"device": str(getattr(engine, "device", "")),  # where it ran (the gpu check asserts it)
                 "attn": attn_record(engine),
                 "tied_table": getattr(engine, "_table", None) is not None}  # engines/sharded_vocab.py

    batch_fn = make_group_batch if v.get("batch") == "groups" else make_batch

    def local(seed):
        return local_batch(engine, batch_fn(seed))

    if v.get("warm_up"):
        engine.warm_up()
    if v.get("load"):
        engine.load(SaveLoadMeta(path=v["load"], weight_format="dcp"))
    if v.get("load_hf"):
        engine.load(SaveLoadMeta(path=v["load_hf"], weight_format="hf"))
    if v.get("spy_masks"):
        res["mask_calls"] = spy_masks(engine, batch_fn(0))
        res["n_layers"] = int(engine.hf_config.num_hidden_layers)
    if v.get("fwd", False):
        res["logprobs"] = engine.forward(batch_fn(0) if engine.is_dp_head else None)
    if v.get("fwd_t"):  # logprobs and entropy at a sampling temperature other than 1
        res["logprobs_t"] = engine.forward(batch_fn(0) if engine.is_dp_head else None, temperature=v["fwd_t"])
    if v.get("probe", False):
        res["logprobs"] = engine.forward(batch_fn(0) if engine.is_dp_head else None)
        engine._accumulate_grads(local(0), loss_fn, loss_weight_fn, 1.0)
        res["grads"] = full_grads(engine)
        engine.optimizer.zero_grad(set_to_none=True)
    probe = megatron_grad_probe(engine) if v.get("grad_probe") else None
    res["stats"] = []
    for step in range(v.get("start", 0), v.get("steps", 2)):
        if step == v.get("warm_up_before_step"):
            engine.warm_up()
        res["stats"].append(engine.train_batch(local(step), loss_fn, loss_weight_fn))
    res["weights"] = full_weights(engine)
    res["tied_rows"] = tied_rows_record(engine)
    if probe is not None:
        import torch.distributed as dist

        from areal_cli.utils import collectives

        res["grad_probe"] = [None] * dist.get_world_size()
        collectives.all_gather_object(res["grad_probe"], probe)
    finish_variant(engine, v, res, out_dir)
    if v.get("kill_after"):
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    from areal_cli.utils.dist import init_distributed

    init_distributed(spec.get("backend", "gloo"))
    for v in spec["variants"]:
        model_dir = v.get("model") or spec["model_dir"]
        (run_critic if v.get("critic") else run_variant)(v, model_dir, spec["out"])


def variants_main(run) -> None:
    """The main of a worker script that runs ``run(variant, model_dir, out)`` for each variant of the spec
    ``launch`` passed in argv, on gloo, one torch thread per rank."""
    import torch

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    from areal_cli.utils.dist import init_distributed

    init_distributed("gloo")
    for v in spec["variants"]:
        run(v, spec["model_dir"], spec["out"])


def launch(spec: dict, world_size: int, timeout: float = 300.0, expect_kill: bool = False,
           script: str | None = None) -> None:
    """Start ``world_size`` worker processes and wait; raise with their output on failure."""
    from areal_cli.utils.network import find_free_port

    port = find_free_port()
    procs = []
    for r in range(world_size):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        procs.append(subprocess.Popen([sys.executable, script or __file__, json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    ok = all(c == -signal.SIGKILL for c in codes) if expect_kill else all(c == 0 for c in codes)
    if not ok:
        raise RuntimeError(f"workers exited with {codes}:\n" + "\n----\n".join(o[-4000:] for o in outs))


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
