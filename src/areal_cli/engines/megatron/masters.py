"""The fp32 master weights of a megatron engine under bf16 (engines/precision.py): where mcore keeps them, and
putting them back from the checkpoint at full precision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from areal_cli.engines.base import VALUE_HEAD_FILE


def slots(optimizer: Any):
    """``(model parameter, its fp32 master, flat range of the parameter it holds or None)`` for every bf16
    parameter: mcore's Float16 optimizer keeps whole masters, the distributed optimizer this rank's shard."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            for models, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
                for p, m in zip(models, mains):
                    r = opt._get_model_param_range_map(p)["param"]
                    yield p, m, (r.start, r.end)
        else:
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, m in zip(models, mains):
                    yield p, m, None


@torch.no_grad()
def restore(engine: Any, path: str) -> None:
    """Put the engine's fp32 masters back from the checkpoint at ``path``. mcore builds them from the bf16
    module, which rounded every weight once: an fp32 checkpoint would start training from its bf16 copy.
    Layer by layer, this rank's slices only (as the load); a freshly drawn value head keeps its master."""
    from areal_cli.engines.megatron import convert

    where = {id(p): (m, rng) for p, m, rng in slots(engine.optimizer)}
    src = engine._hf_source(path, torch.float32, init_head=True)
    fresh_head = engine.critic and not (Path(path) / VALUE_HEAD_FILE).is_file()
    for chunk in engine.chunks:
        params = dict(chunk.named_parameters())
        for group in convert.mcore_groups(src, engine.mc_arch, chunk, engine.tp_rank, engine.parallel.tp,
                                          engine.experts):
            for name, t in group.items():
                slot = where.get(id(params[name])) if name in params else None
                if slot is None or (fresh_head and name.startswith("output_layer.head.")):
                    continue
                m, rng = slot
                flat = t.reshape(-1) if rng is None else t.reshape(-1)[rng[0]:rng[1]]
                m.data.view(-1).copy_(flat)
