"""Worker for the precision test: one engine with ``engine.dtype=bfloat16``, built and stepped once.

Records what bf16 means on that engine (engines/precision.py): the dtype and the values of the master
weights right after ``initialize`` (each rank's own masters, compared with the checkpoint's fp32 tensors
here), the dtypes of the optimizer state after a step, the dtype the LM head's logits come out in, and
whether the module computes in bf16 (a linear layer's output dtype). Rank 0 writes
``<out>/<variant>.json``. The engine's own masters are read where each backend keeps them: the module's
parameters (fsdp, archon), DeepSpeed's fp32 partitions, mcore's ``main_params``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _masters(engine, name: str):
    """``(hf-ish name, fp32 master tensor, flat range of the full tensor or None)`` for this rank."""
    import torch

    if name in ("fsdp", "archon"):
        for n, p in engine.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield n.replace("stage0.", "").replace("stage1.", ""), full.detach(), None, local.dtype
    elif name == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        for n, p in engine.ds.module.named_parameters():
            yield n, safe_get_full_fp32_param(p), None, safe_get_full_fp32_param(p).dtype
    else:  # megatron: compare mcore names against the checkpoint converted to mcore layout
        from areal_cli.engines.megatron import convert, masters

        src = engine._hf_source(engine.model_path, torch.float32, init_head=True)
        ids = {id(p): (m, rng) for p, m, rng in masters.slots(engine.optimizer)}
        for chunk in engine.chunks:
            params = dict(chunk.named_parameters())
            want = convert.hf_to_mcore(src, engine.mc_arch, chunk, engine.tp_rank, engine.parallel.tp,
                                       engine.experts)
            for n, p in params.items():
                if id(p) not in ids:  # the distributed optimizer: no shard of this one on this rank
                    continue
                m, rng = ids[id(p)]
                ref = want[n].reshape(-1) if rng is None else want[n].reshape(-1)[rng[0]:rng[1]]
                yield n, m.detach().reshape(-1), ref, m.dtype


def run(spec: dict) -> dict:
    import torch
    from fsdp_worker import engine_config, local_batch, make_batch

    from areal_cli.algorithms.actor import sft_step
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.weight_sync.hf_io import HFCheckpoint

    name = spec["engine"]
    ekw = {"dtype": "bfloat16", "max_tokens_per_mb": 10_000, **spec.get("engine_kw", {})}
    engine = get_engine_cls(name)(engine_config(ekw), OptimConfig(lr=1e-3), total_steps=2, seed=0)
    engine.initialize(ParallelStrategy(**spec.get("parallel", {})), spec["model_dir"])
    ckpt = HFCheckpoint(spec["model_dir"])
    out: dict = {"masters": {}, "device": str(engine.device)}
    for n, master, ref, dtype in _masters(engine, name):
        if ref is None:
            if n not in ckpt.names():
                continue
            ref = ckpt.get(n).float().reshape(-1)
        out["masters"][n] = {"dtype": str(dtype), "max_diff": (master.float().reshape(-1).cpu() - ref).abs()
                             .max().item() if ref.numel() else 0.0}
    # bf16-rounded masters would be off by up to 2^-9 of a weight's magnitude: the checkpoint is fp32
    out["bf16_rounding_of_ckpt"] = max((t.float() - t.to(torch.bfloat16).float()).abs().max().item()
                                       for t in (ckpt.get(n) for n in ckpt.names()))
    heads, linears = [], []

    def on_head(mod, args, output):
        o = output[0] if isinstance(output, tuple) else output
        heads.append(str((o.to_local() if hasattr(o, "to_local") else o).dtype))

    def on_linear(mod, args, output):
        o = output[0] if isinstance(output, tuple) else output
        linears.append(str((o.to_local() if hasattr(o, "to_local") else o).dtype))

    for n, m in engine.model.named_modules():
        if n.endswith("lm_head") or n.endswith("output_layer"):
            m.register_forward_hook(on_head)
        elif n.endswith(("mlp.down_proj", "linear_fc2")):
            m.register_forward_hook(on_linear)
    stats = sft_step(engine, local_batch(engine, make_batch(0)))
    out["loss"] = float(stats["loss"])
    out["head_dtypes"], out["linear_dtypes"] = sorted(set(heads)), sorted(set(linears))
    states = []
    opt = engine.optimizer
    inner = [o.optimizer for o in (getattr(opt, "chained_optimizers", None) or [opt])] if name == "megatron" \
        else [getattr(opt, "optimizer", opt)]
    for o in inner:
        for st in o.state.values():
            states += [str(v.dtype) for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1]
    out["optim_state_dtypes"] = sorted(set(states))
    return out


def main() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    from areal_cli.utils.dist import init_distributed

    init_distributed(spec.get("backend", "gloo"))
    res = run(spec)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(res))


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
