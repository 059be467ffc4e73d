"""Worker process for the megatron-core groundwork tests (one process per rank, gloo on CPU).

``python megatron_worker.py <json spec>`` with RANK/WORLD_SIZE/... set by ``fsdp_worker.launch``.
mode "convert": for every layout in the spec (re-initialising mcore's model parallel state on the same
process group) and every model family, HF -> mcore -> HF and the mcore forward logits vs HF's.
mode "compat": each CPU-shim patch, run unpatched (must hit CUDA) and patched (must work), TP1 PP2.
mode "sharded": the engine's checkpoint reads, whole-model loads and export gathers, counted per rank.
Rank 0 writes ``<out>/result.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

L, B, N_MB = 12, 2, 2


def hf_model(family: str, seed: int = 0):
    import torch
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if family == "qwen2":  # tied, q/k/v biases
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
    elif family == "qwen3":  # untied, q/k norms, head_dim ≠ hidden/heads
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=24, **common)
    else:
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():  # norms start at 1: make them random so a swapped norm is visible
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def batch():
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (N_MB * B, L), generator=g)
    return ids, torch.arange(L)[None].expand(N_MB * B, L)


def causal_mask(b: int, s: int):
    import torch

    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)


def run_forward(models, ids, pos):
    """Forward-only through mcore's own pipeline schedule; on the last stage, the full-vocab logits."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = [{"tokens": ids[i * B:(i + 1) * B], "position_ids": pos[i * B:(i + 1) * B]} for i in range(N_MB)]

    def step(it, model):
        b = next(it)
        out = model(b["tokens"], b["position_ids"], causal_mask(B, L))
        return out, lambda o: (o.sum() * 0, {"logits": o.detach()})

    its = [iter(data) for _ in models] if len(models) > 1 else iter(data)
    res = get_forward_backward_func()(forward_step_func=step, data_iterator=its, model=models,
                                      num_microbatches=N_MB, seq_length=L, micro_batch_size=B,
                                      forward_only=True)
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    tp = mpu.get_tensor_model_parallel_world_size()
    out = []
    for r in res:
        parts = [torch.empty_like(r["logits"]) for _ in range(tp)]
        dist.all_gather(parts, r["logits"].contiguous(), group=mpu.get_tensor_model_parallel_group())
        out.append(torch.cat(parts, -1))  # vocab-parallel logits [b, s, V/t]
    return torch.cat(out, 0)


def convert_layout(layout: dict, families: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401
    from megatron.core import parallel_state as mpu

    from areal_cli.engines.megatron import convert
    from areal_cli.engines.megatron import model as mm

    tp, pp, vpp = layout["t"], layout["p"], layout.get("v", 1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    tp_rank, tp_group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
    report = {}
    ids, pos = batch()
    for fam in families:
        hf = hf_model(fam)
        sd = {k: v.detach() for k, v in hf.state_dict().items()}
        arch = mm.hf_arch(hf.config)
        torch.manual_seed(123)  # mcore's own init differs from the HF weights: the load must overwrite all
        models = mm.build_chunks(arch, mm.transformer_config(arch, tp=tp, pp=pp, vpp=vpp))
        convert.load_hf(models, sd, arch, tp_rank, tp)
        mine = convert.mcore_to_hf(models, arch, tp_group, tp)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        with torch.no_grad():
            logits = run_forward(models, ids, pos)
            ref = hf(ids).logits
        diff = -1.0 if logits is None else float((logits - ref).abs().max())
        diffs = [None] * dist.get_world_size()
        dist.all_gather_object(diffs, diff)
        back: dict = {}
        for d in gathered:
            for k, v in d.items():
                if k in back and not torch.equal(back[k], v):
                    back[k + " (stages disagree)"] = v
                back.setdefault(k, v)
        want = {k for k in sd if not (arch.tied and k == "lm_head.weight")}
        report[fam] = {
            "missing": sorted(want - back.keys()), "extra": sorted(back.keys() - want),
            "not_equal": sorted(k for k in want & back.keys() if not torch.equal(back[k], sd[k])),
            "max_abs_diff": max((float((back[k] - sd[k]).abs().max()) for k in want & back.keys()),
                                default=0.0),
            "logits_max_diff": max(diffs), "logit_ranks": sum(d >= 0 for d in diffs)}
    mpu.destroy_model_parallel()
    return report


def _err(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the probe reports whatever the unpatched code raises
        return f"{type(e).__name__}: {e}"[:300]
    return "no error"


def _uneven_tokens() -> None:
    """What the MoE dispatcher does under expert tensor parallelism: gather, then reduce-scatter, token rows whose
    count differs per rank (rank r holds r + 2 rows of value r + 1)."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    group, r = dist.group.WORLD, dist.get_rank()
    sizes = [k + 2 for k in range(dist.get_world_size())]
    mine = torch.full((sizes[r], 3), float(r + 1))
    got = mappings._gather_along_first_dim(mine, group, sizes)
    want = torch.cat([torch.full((n, 3), float(k + 1)) for k, n in enumerate(sizes)])
    if not torch.equal(got, want):
        raise RuntimeError("uneven gather returned the wrong rows")
    back = mappings._reduce_scatter_along_first_dim(want, group, sizes)
    if not torch.equal(back, mine * dist.get_world_size()):
        raise RuntimeError("uneven reduce-scatter returned the wrong rows")


def compat_probes() -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from areal_cli.engines.megatron import compat, convert
    from areal_cli.engines.megatron import model as mm

    compat.check_version()
    ps = {p.name: p for p in compat.patches()}
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    rank = mpu.get_pipeline_model_parallel_rank()
    hf = hf_model("qwen2")  # tied: the embedding copy on the last stage goes through the .cuda() call
    arch = mm.hf_arch(hf.config)
    # eager: mcore's own DotProductAttention, whose score buffer and default causal mask two patches cover
    cfg = mm.transformer_config(arch, pp=2, attn_impl="eager")
    out: dict = {}

    def probe(name, unpatched, patched):
        out[name] = {"unpatched": _err(unpatched)}
        dist.barrier()
        ps[name].apply()
        out[name]["patched"] = _err(patched)
        dist.barrier()

    holder: list = []
    probe("tied_embeddings_cuda", lambda: mm.build_chunks(arch, cfg, attn_impl="eager"),
          lambda: holder.extend(mm.build_chunks(arch, cfg, attn_impl="eager")))
    m = holder[0]
    convert.load_hf([m], {k: v.detach() for k, v in hf.state_dict().items()}, arch, 0, 1)
    ids, pos = batch()
    ids, pos = ids[:B], pos[:B]
    hidden = torch.randn(L, B, arch.hidden_size, generator=torch.Generator().manual_seed(1))

    def fwd(mask):
        if rank == 1:
            m.set_input_tensor(hidden)
        with torch.no_grad():
            return m(ids, pos, mask)

    probe("rotary_inv_freq", lambda: fwd(causal_mask(B, L)), lambda: None)
    probe("global_memory_buffer", lambda: fwd(causal_mask(B, L)), lambda: None)
    ref: list = []
    probe("rng_tracker", lambda: fwd(causal_mask(B, L)), lambda: ref.append(fwd(causal_mask(B, L))))

    def default_mask_matches():
        if not torch.equal(fwd(None), ref[0]):
            raise RuntimeError("default causal mask gives a different output than the explicit one")

    probe("default_causal_mask", default_mask_matches, default_mask_matches)
    probe("schedules_total_tokens", lambda: run_forward([m], *batch()), lambda: None)
    p2p = P2PCommunicator(pp_group=mpu.get_pipeline_model_parallel_group(), config=cfg)
    sent = torch.arange(L * B * arch.hidden_size, dtype=torch.float32).reshape(L, B, arch.hidden_size)

    def exchange():
        if rank == 0:
            p2p.send_forward(sent, is_last_stage=False)
        elif not torch.equal(p2p.recv_forward(tuple(sent.shape), is_first_stage=False), sent):
            raise RuntimeError("received activations differ from the sent ones")

    unpatched_recv = (lambda: p2p.recv_forward(tuple(sent.shape), False)) if rank == 1 else (lambda: None)
    probe("p2p_buffers", unpatched_recv, exchange)
    ps["sequence_parallel_mappings"].apply()  # the buffers' CUDA allocation comes first, before gloo's size check
    probe("uneven_gather_scatter", _uneven_tokens, _uneven_tokens)
    out["rank"] = rank
    mpu.destroy_model_parallel()
    return out


# The training-path patches (mcore DDP, optimizers, sequence parallelism, MoE) and the engine setup whose one
# train_batch reaches each one's code path: t2 with sequence parallelism, the distributed optimizer and a
# clip threshold below the gradient norm; bf16 with the plain (non-distributed) mixed-precision optimizer;
# the tiny Qwen3-MoE at d2e2 (alltoall dispatch, with the router's aux loss on). The uneven token gathers of
# expert tensor parallelism need 4 ranks: compat_probes calls that mcore function directly.
TRAIN_PATCHES = {"grad_buffers": "sp", "optimizer_buffers": "sp", "grad_norm": "sp",
                 "distributed_optimizer_type_check": "sp", "sequence_parallel_buffers": "sp",
                 "sequence_parallel_mappings": "sp", "float16_optimizer_type_check": "bf16",
                 "moe_dispatcher_streams": "moe", "moe_router_gemm": "moe", "alltoall_split_lists": "moe",
                 "moe_router_device": "moe"}
SETUPS = {"sp": {"tp": 2}, "bf16": {"tp": 2}, "moe": {"dp": 2, "ep": 2}}


def _train_step(model_dir: str, setup: str) -> None:
    """One megatron train_batch in ``setup`` (see SETUPS); MoE setups read ``model_dir`` as the MoE model."""
    from fsdp_worker import loss_fn, loss_weight_fn, make_batch

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig, MegatronConfig
    from areal_cli.engines.megatron import engine as me

    mc = MegatronConfig(use_distributed_optimizer=setup != "bf16", moe_aux_loss_coeff=0.01 if setup == "moe" else 0.0)
    cfg = EngineConfig(dtype="bfloat16" if setup == "bf16" else "float32", megatron=mc)
    engine = me.MegatronEngine(cfg, OptimConfig(lr=1e-3, grad_clip=1e-3), total_steps=2)
    try:
        engine.initialize(ParallelStrategy(**SETUPS[setup]), model_dir)
        stats = engine.train_batch(make_batch(0, vocab=300), loss_fn, loss_weight_fn)
        if not stats["grad_norm"] > 1e-3:
            raise RuntimeError(f"the gradient norm {stats['grad_norm']} does not exercise clipping")
    finally:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()


def train_compat_probes(model_dir: str, moe_model_dir: str) -> dict:
    """Leave one out: with every other patch applied, one train_batch must fail on CUDA; with all, it runs."""
    import torch.distributed as dist

    from areal_cli.engines.megatron import compat

    compat.check_version()
    out: dict = {}
    for name, setup in TRAIN_PATCHES.items():
        for p in compat.patches():
            if p.name != name:
                p.apply()
                compat._APPLIED.append(p)
        model = moe_model_dir if setup.startswith("moe") else model_dir
        out[name] = {"unpatched": _err(lambda: _train_step(model, setup))}
        compat.revert_cpu_compat()
        dist.barrier()
        compat.apply_cpu_compat()
        out[name]["patched"] = _err(lambda: _train_step(model, setup))
        compat.revert_cpu_compat()
        dist.barrier()
    return out


def _instrument() -> dict:
    """Count, on this rank, the checkpoint bytes read per tensor (through HFCheckpoint, the engine's reader), the
    calls that would read a whole model (``AutoModelForCausalLM.from_pretrained``, ``safetensors`` ``load_file``
    of a model file) and the export's gathers (``convert._gather``). Returns the live counters."""
    import safetensors.torch
    import transformers

    from areal_cli.engines.megatron import convert
    from areal_cli.weight_sync import hf_io

    rec: dict = {"reads": {}, "from_pretrained": 0, "load_file_model": 0, "gathers": 0, "expert_gathers": 0}

    def count(name, t):
        rec["reads"][name] = rec["reads"].get(name, 0) + t.numel() * t.element_size()
        return t

    get, get_rows = hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_rows
    hf_io.HFCheckpoint.get = lambda self, name: count(name, get(self, name))
    hf_io.HFCheckpoint.get_rows = lambda self, name, a, b: count(name, get_rows(self, name, a, b))
    from_pretrained = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def fp(cls, *a, **kw):
        rec["from_pretrained"] += 1
        return from_pretrained(cls, *a, **kw)

    transformers.AutoModelForCausalLM.from_pretrained = classmethod(fp)
    load_file = safetensors.torch.load_file

    def lf(path, *a, **kw):
        rec["load_file_model"] += Path(path).name.startswith("model")
        return load_file(path, *a, **kw)

    safetensors.torch.load_file = lf
    gather = convert._gather

    def g(t, dim, group, tp):
        from megatron.core import parallel_state as mpu

        rec["gathers" if group is mpu.get_tensor_model_parallel_group() else "expert_gathers"] += 1
        return gather(t, dim, group, tp)

    convert._gather = g
    return rec


def sharded_case(case: dict, rec: dict) -> dict:
    """One engine: initialize (counting reads), export (counting gathers; rank 0 compares with the checkpoint),
    then load the model dir into the running engine (counting reads again)."""
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines.megatron import engine as me
    from areal_cli.weight_sync.hf_io import HFCheckpoint

    rec.update(reads={}, from_pretrained=0, load_file_model=0, gathers=0, expert_gathers=0)
    engine = me.MegatronEngine(EngineConfig(), OptimConfig(lr=1e-3), total_steps=2)
    engine.initialize(ParallelStrategy(**case["parallel"]), case["model_dir"])
    out = {"coords": list(engine._coords[dist.get_rank()]), "init_reads": dict(rec["reads"]),
           "from_pretrained": rec["from_pretrained"], "load_file_model": rec["load_file_model"]}
    got = {n: t for n, t in engine._named_full_tensors() if t is not None}
    out["export_gathers"], out["export_expert_gathers"] = rec["gathers"], rec["expert_gathers"]
    if dist.get_rank() == 0:
        ck = HFCheckpoint(case["model_dir"])
        want = set(ck.names()) - ({"lm_head.weight"} if engine.mc_arch.tied else set())
        out["export_diff"] = sorted(set(got) ^ want) + [n for n in want & set(got) if not torch.equal(got[n], ck.get(n))]
    rec["reads"] = {}
    engine.load(SaveLoadMeta(path=case["model_dir"], weight_format="hf"))
    out["load_reads"] = dict(rec["reads"])
    out["from_pretrained"] += rec["from_pretrained"]
    engine.destroy()
    return out


def sharded(spec: dict) -> dict:
    import torch.distributed as dist

    from areal_cli.engines.megatron import compat
    from areal_cli.weight_sync.hf_io import HFCheckpoint

    compat.apply_cpu_compat()
    rec = _instrument()
    result = {}
    for case in spec["cases"]:
        mine = sharded_case(case, rec)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        ck = HFCheckpoint(case["model_dir"])
        result[case["name"]] = {"ranks": ranks, "sizes": {n: ck.nbytes(n) for n in ck.names()}}
    return result


def main() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    if spec["mode"] == "sharded":
        result = sharded(spec)
    elif spec["mode"] in ("compat", "train_compat"):
        res = compat_probes() if spec["mode"] == "compat" else train_compat_probes(spec["model_dir"],
                                                                                 spec["moe_model_dir"])
        allres = [None] * dist.get_world_size()
        dist.all_gather_object(allres, res)
        result = {"ranks": allres}
    else:
        from areal_cli.engines.megatron import compat

        compat.apply_cpu_compat()
        result = {f"t{lay['t']}p{lay['p']}v{lay.get('v', 1)}": convert_layout(lay, spec["families"])
                  for lay in spec["layouts"]}
    if dist.get_rank() == 0:
        Path(spec["out"], "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from areal_cli.utils.dist import exit_after

    exit_after(main)
