"""Worker for test_keep_sampling_mask.py: a real FSDP engine (world 1, gloo) recomputes the logprobs
of a batch the hf server generated, through ``forward`` and through the training path's loss.

Also the Archon engine (``"cls": "archon"``, ``"parallel"``) under ``WORLD_SIZE`` ranks.

argv[1]: JSON ``{"model_dir", "batch", "out", "temperature", "variants": [{"name", "engine"}]}``;
``batch`` is a ``torch.save`` of the trainer batch; a variant with ``"mask": false`` drops its
``sampling_cutoff`` (later variants too: list masked ones first). Writes ``{name: {"forward": [B, L], "train": [B, L]}}`` to ``out`` with ``.<rank>`` before ``.pt``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls

    spec = json.loads(sys.argv[1])
    batch = torch.load(spec["batch"], weights_only=False)
    temperature = spec["temperature"]
    res = {}
    for v in spec["variants"]:
        if not v.get("mask", True):
            batch = {k: t for k, t in batch.items() if k != "sampling_cutoff"}
        cls = get_engine_cls(v.get("cls", "fsdp"))
        engine = cls(EngineConfig(**v["engine"]), OptimConfig(lr=1e-3), total_steps=1, seed=0)
        engine.initialize(ParallelStrategy(**v.get("parallel", {})), spec["model_dir"])
        fwd = engine.forward(dict(batch), temperature=temperature)["logprobs"].cpu()
        seen = torch.zeros_like(fwd)

        def loss_fn(out, mb, seen=seen):
            # micro-batches may reorder rows: ``row`` ([B]) says which each one is
            rows = mb["row"].cpu()
            seen[rows, : out["logprobs"].shape[1]] = out["logprobs"].detach().cpu()
            return (out["logprobs"] * mb["loss_mask"]).sum() * 0.0, {}

        engine._accumulate_grads(dict(batch), loss_fn, lambda mb: float(mb["loss_mask"].sum()), temperature)
        res[v["name"]] = {"forward": fwd, "train": seen}
        engine.destroy()
    # every rank writes its own: under pipelining only the last stage runs the loss
    torch.save(res, spec["out"].replace(".pt", f".{dist.get_rank()}.pt"))


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
