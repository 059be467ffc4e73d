"""Worker for the ZeRO-3 initialisation test: how much of the model a rank ever holds while the engine
builds and loads it, and who reads the checkpoint.

Every rank patches ``from_pretrained`` to raise (the engine must build the model from its config), counts
its calls of the HF reader (:class:`~areal_cli.weight_sync.hf_io.HFCheckpoint`: whole tensors and row
slices, in elements), and tracks the parameter elements it holds (a partition, or the whole tensor while
a module is being built or a bucket is gathered) at every parameter registration and every gather. After
``initialize`` it records each parameter's local partition and the full weights the engine exports.
Rank 0 also builds the model with the real ``from_pretrained`` afterwards and records its buffers and
weights, to compare with. Each rank writes ``<out>/<variant>_rank<r>.pt``.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def run(v: dict, model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero import GatheredParameters
    from fsdp_worker import engine_config
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.weight_sync import hf_io

    params: list = []
    peak = [0]

    def resident() -> int:
        n = 0
        seen = set()  # a tied parameter is registered twice
        for ref in params:
            p = ref()
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            n += p.data.numel()
            if getattr(p, "ds_tensor", None) is not None:
                n += p.ds_tensor.numel()
        peak[0] = max(peak[0], n)
        return n

    def strays() -> int:
        """Parameters built during initialize that the engine's module no longer holds but that stay alive."""
        live = {id(p) for p in engine.ds.module.parameters()}
        return len({id(ref()) for ref in params if ref() is not None and id(ref()) not in live})

    def on_param(module, name, param):
        params.append(weakref.ref(param))
        resident()

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(on_param)
    enter = GatheredParameters.__enter__

    def gathered_enter(self):
        r = enter(self)
        resident()
        return r

    GatheredParameters.__enter__ = gathered_enter
    reads = {"get": 0, "rows": 0, "elements": 0}
    get, get_rows = hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_rows

    def counted_get(self, name):
        t = get(self, name)
        reads["get"] += 1
        reads["elements"] += t.numel()
        return t

    def counted_rows(self, name, start_row, stop_row):
        t = get_rows(self, name, start_row, stop_row)
        reads["rows"] += 1
        reads["elements"] += t.numel()
        return t

    hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_rows = counted_get, counted_rows
    real_auto = AutoModelForCausalLM.from_pretrained
    saved = {cls: vars(cls).get("from_pretrained") for cls in (AutoModelForCausalLM, PreTrainedModel)}

    def refuse(*a, **k):
        raise AssertionError("from_pretrained called: the whole model would be loaded on this rank")

    for cls in saved:
        cls.from_pretrained = classmethod(refuse)
    engine = get_engine_cls("deepspeed")(engine_config(v["engine"]), OptimConfig(lr=1e-3), total_steps=2, seed=0)
    try:
        engine.initialize(ParallelStrategy(**v["parallel"]), model_dir)
    finally:
        for cls, orig in saved.items():
            if orig is None:
                delattr(cls, "from_pretrained")
            else:
                cls.from_pretrained = orig
        hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_rows = get, get_rows
        GatheredParameters.__enter__ = enter
        handle.remove()
    module = engine.ds.module
    res = {"reads": reads, "peak": peak[0], "resident_after": resident(), "strays": strays(),
           "partitions": {n: (int(p.ds_numel), int(p.ds_tensor.numel()), int(p.data.numel()))
                          for n, p in module.named_parameters()},
           "tied": module.lm_head.weight is module.model.embed_tokens.weight,
           # whether the optimizer steps the module's own partition (fp32) or a master copy of it (bf16)
           "shares": [a.data_ptr() == b.data_ptr() for a, b in zip(engine.ds.optimizer.fp16_partitioned_groups_flat,
                                                                  engine.ds.optimizer.fp32_partitioned_groups_flat)],
           "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
           "weights": {n: t.clone() for n, t in engine._named_full_tensors() if t is not None}}
    if dist.get_rank() == 0:
        ref = real_auto(model_dir, dtype=torch.float32)
        res["ref_buffers"] = {n: b.detach().clone() for n, b in ref.named_buffers()}
        res["ref_weights"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
        res["ref_total"] = sum(p.numel() for p in ref.parameters())
    torch.save(res, Path(out) / f"{v['name']}_rank{dist.get_rank()}.pt")
    dist.barrier()
    engine.destroy()


if __name__ == "__main__":
    from fsdp_worker import variants_main

    from areal_cli.utils.dist import exit_after

    exit_after(lambda: variants_main(run))
