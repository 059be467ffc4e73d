"""``engine.dtype=bfloat16`` means one thing on every engine (engines/precision.py): bf16 compute, fp32 master
weights equal to the checkpoint (not its bf16 rounding), fp32 optimizer state, fp32 logits from the LM head.

Each variant is one real engine on gloo ranks (tests/support/precision_worker.py), built and stepped once.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from fsdp_worker import launch  # noqa: E402

WORKER = str(Path(__file__).resolve().parents[2] / "support" / "precision_worker.py")

VARIANTS = {
    # name: (engine, world, parallel, engine kwargs)
    "fsdp_d1": ("fsdp", 1, {}, {}),  # one rank: autocast over the fp32 module
    "fsdp_d2": ("fsdp", 2, {"dp": 2}, {}),  # FSDP2 MixedPrecisionPolicy
    "archon_t2": ("archon", 2, {"tp": 2}, {}),
    "deepspeed_z3_d2": ("deepspeed", 2, {"dp": 2}, {"deepspeed": {"zero_stage": 3}}),
    "deepspeed_z1_d1": ("deepspeed", 1, {}, {"deepspeed": {"zero_stage": 1}}),
    "megatron_d1": ("megatron", 1, {}, {"megatron": {"use_distributed_optimizer": False}}),
    "megatron_d2_distopt": ("megatron", 2, {"dp": 2}, {}),
}
MARKS = {n: [pytest.mark.engines] + ([pytest.mark.megatron] if v[0] == "megatron" else [])
         for n, v in VARIANTS.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS[n]) for n in VARIANTS])
def test_bf16_is_bf16_compute_over_fp32_masters(name, tiny_model_dir, tmp_path):
    engine, world, parallel, ekw = VARIANTS[name]
    out = tmp_path / f"{name}.json"
    launch({"engine": engine, "parallel": parallel, "engine_kw": ekw, "model_dir": tiny_model_dir,
            "out": str(out)}, world, timeout=600, script=WORKER)
    res = json.loads(out.read_text())
    masters = res["masters"]
    assert len(masters) >= 5, sorted(masters)  # the distributed optimizer: this rank's share
    assert {m["dtype"] for m in masters.values()} == {"torch.float32"}
    worst = max(m["max_diff"] for m in masters.values())
    # The masters are the checkpoint's fp32 values: a master built from the bf16 module would be off by
    # the checkpoint's bf16 rounding, which is far above zero for this model.
    assert res["bf16_rounding_of_ckpt"] > 1e-4
    assert worst == 0.0, {k: m for k, m in masters.items() if m["max_diff"]}
    assert res["optim_state_dtypes"] == ["torch.float32"]
    assert res["head_dtypes"] == ["torch.float32"]  # logits (and log-softmax after them) in fp32
    assert res["linear_dtypes"] == ["torch.bfloat16"]  # the matmuls run in bf16
    assert math.isfinite(res["loss"])
