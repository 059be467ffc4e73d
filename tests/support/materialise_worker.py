"""A gloo rank that initializes one engine on a ~100 MB model and reports what it read and held.

Run by tests/integration/engines/test_sharded_materialisation.py through ``fsdp_worker.launch``. Each rank:

- makes ``AutoModelForCausalLM.from_pretrained`` raise (no engine may load the whole HF model);
- counts the checkpoint bytes it reads through ``HFCheckpoint`` (positioned reads: only what is read counts);
- resets the kernel's resident high-water mark (``/proc/self/clear_refs``) right before ``initialize`` and
  reads ``VmHWM`` after it: the peak resident memory ``initialize`` added above the rank's baseline;
- checks the engine's forward against the one-process HF model's (loaded by rank 0 after the measurement);

and writes ``{rank: {"read", "peak_growth", "ckpt_bytes", "largest", "logprobs_diff"}}`` to ``out``.
"""

from __future__ import annotations

import json
import os
import re
import sys


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _warm_imports(spec: dict) -> None:
    """Import what ``initialize`` imports lazily (the model's modeling code, accelerate, megatron-core's
    model, DDP and optimizer packages) and build the model once with meta parameters, so the growth
    measured is the engine's tensors, not module code."""
    import importlib

    import torch
    from transformers import AutoConfig

    from areal_cli.engines import materialize

    cfg = AutoConfig.from_pretrained(spec["model"])
    materialize.meta_model(cfg, torch.float32, "sdpa")
    if spec["engine"] == "megatron":
        for mod in ("megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                    "megatron.core.pipeline_parallel.schedules"):
            importlib.import_module(mod)


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch
    import torch.distributed as dist
    import transformers

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import DeepSpeedConfig, EngineConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.utils.dist import init_distributed
    from areal_cli.weight_sync import hf_io

    torch.set_num_threads(1)
    init_distributed("gloo")
    read = [0]
    orig_read = hf_io.HFCheckpoint._read

    def counting_read(self, f, dtype, shape, offset, nbytes):
        read[0] += nbytes
        return orig_read(self, f, dtype, shape, offset, nbytes)

    hf_io.HFCheckpoint._read = counting_read

    def refuse(*a, **k):
        raise AssertionError("an engine called AutoModelForCausalLM.from_pretrained: the whole model on a rank")

    orig_from_pretrained = transformers.AutoModelForCausalLM.from_pretrained
    transformers.AutoModelForCausalLM.from_pretrained = refuse
    ecfg = EngineConfig(max_tokens_per_mb=256)
    if spec.get("zero"):
        ecfg.deepspeed = DeepSpeedConfig(zero_stage=int(spec["zero"]))
    engine = get_engine_cls(spec["engine"])(ecfg, OptimConfig(lr=1e-4), total_steps=2, seed=0)
    dims = {k: spec[k] for k in ("dp", "tp", "pp", "ep") if k in spec}
    _warm_imports(spec)  # module code is not model memory: load it before the measurement
    open("/proc/self/clear_refs", "w").write("5")
    base = _kib("VmRSS")
    engine.initialize(ParallelStrategy(**dims), spec["model"])
    peak = _kib("VmHWM") - base
    transformers.AutoModelForCausalLM.from_pretrained = orig_from_pretrained
    hf_io.HFCheckpoint._read = orig_read
    ck = hf_io.HFCheckpoint(spec["model"])
    ids = torch.randint(1, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones_like(ids, dtype=torch.float32)}
    got = engine.forward(batch if engine.is_dp_head else None)["logprobs"]
    diff = None
    if dist.get_rank() == 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids).logits.float(), -1)
        want = torch.zeros_like(got)
        want[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        diff = float((want - got).abs().max())
    row = {"read": read[0], "peak_growth": peak, "ckpt_bytes": sum(ck.nbytes(n) for n in ck.names()),
           "largest": max(ck.nbytes(n) for n in ck.names()), "logprobs_diff": diff}
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, row)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(dict(enumerate(box)), f)
    dist.barrier()
    engine.destroy()
    os._exit(0)


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
