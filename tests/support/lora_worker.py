"""Worker for the LoRA engine tests (one process per rank, gloo on CPU; started by ``fsdp_worker.launch``).

Each variant builds an engine with ``model.lora`` on the same process group, trains a few steps and
rank 0 saves ``<out>/<name>.pt``: stats, the full adapter, the full base weights before and after, the
optimizer's state keys, the reference (adapter off) and policy logprobs, and optionally a merged HF
export and a DCP checkpoint written or loaded halfway.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_worker import (  # noqa: E402
    engine_config,
    finish_variant,
    local_batch,
    loss_fn,
    loss_weight_fn,
    make_batch,
)


def _base(engine):
    from areal_cli.engines.lora import is_lora_name

    return {n: t.clone() for n, t in engine._named_full_tensors() if t is not None and not is_lora_name(n)}


def run(v: dict, model_dir: str, out_dir: str) -> None:
    from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.model import LoRAConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.engines.lora import ReferenceView

    lora = LoRAConfig(**v["lora"]) if v.get("lora") else None
    engine = get_engine_cls(v.get("cls", "fsdp"))(engine_config(v.get("engine", {})),
                                                   OptimConfig(lr=1e-3, grad_clip=1e9), total_steps=8, seed=0,
                                                   lora=lora)
    engine.initialize(ParallelStrategy(**v.get("parallel", {})), model_dir)

    head_batch = make_batch(99) if engine.is_dp_head else None
    res: dict = {"base_before": _base(engine), "logp_before": engine.forward(head_batch)["logprobs"]}
    if v.get("load"):
        engine.load(SaveLoadMeta(path=v["load"], weight_format="dcp"))
    steps = range(v.get("start", 0), v["steps"])
    res["stats"] = [engine.train_batch(local_batch(engine, make_batch(s)), loss_fn, loss_weight_fn) for s in steps]
    if lora is not None:
        res["adapter"] = engine.adapter_tensors()
        res["ref_logp"] = ReferenceView(engine).forward(head_batch)["logprobs"]
        res["optim_params"] = sum(len(g["params"]) for g in engine.optimizer.param_groups)
        res["optim_numel"] = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
        res["trainable"] = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    res["logp_after"] = engine.forward(head_batch)["logprobs"]
    res["base_after"] = _base(engine)
    res["batch"] = make_batch(99)
    finish_variant(engine, v, res, out_dir)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    from areal_cli.utils.dist import init_distributed

    init_distributed(spec.get("backend", "gloo"))
    for v in spec["variants"]:
        run(v, spec["model_dir"], spec["out"])


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
