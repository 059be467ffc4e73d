"""engine=deepspeed: its knobs are checked by validate-config (through the registry) and the engine is
trainable by name; the CLI side imports neither torch nor deepspeed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.engines import get_engine_spec
from areal_cli.errors import ConfigError

GPU = ["cluster=gpu_1x8", "model=qwen2_5_1_5b", "engine=deepspeed", "allocation_mode=sglang:d4+deepspeed:d4"]


@pytest.mark.parametrize("overrides,path", [
    (["engine.deepspeed.zero_stage=2", "engine.deepspeed.offload_param=true"], "engine.deepspeed.offload_param"),
    (["engine.deepspeed.zero_stage=0", "engine.deepspeed.offload_optimizer=true"],
     "engine.deepspeed.offload_optimizer"),
    (["engine.deepspeed.bucket_mel=0"], "engine.deepspeed.bucket_mel"),
])
def test_contradicting_knobs_are_refused_by_path(overrides, path):
    with pytest.raises(ConfigError) as info:
        validate(load_config(GPU + overrides))
    assert info.value.path == path


def test_zero3_with_offload_and_ulysses_validates():
    validate(load_config(GPU + ["engine.deepspeed.offload_param=true", "engine.deepspeed.offload_optimizer=true"]))
    validate(load_config(["cluster=gpu_1x8", "model=qwen2_5_1_5b", "engine=deepspeed",
                          "allocation_mode=sglang:d4+deepspeed:d2c2"]))
    with pytest.raises(ConfigError, match="deepspeed does not support tensor parallelism"):
        validate(load_config(GPU[:3] + ["allocation_mode=sglang:d4+deepspeed:d2t2"]))


def test_spec_names_the_engine_and_the_cli_stays_light():
    spec = get_engine_spec("deepspeed")
    assert spec.trainable and spec.target == "areal_cli.engines.deepspeed:DeepSpeedEngine" and spec.dims == "dc"
    code = ("import sys; from areal_cli.plan.compose import load_config; from areal_cli.plan.validate import "
            "validate; validate(load_config(['engine=deepspeed', 'allocation_mode=hf:d1+deepspeed:d2', "
            "'cluster.n_gpus_per_node=3'])); print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
