"""validate-config on engine.attn_impl: unknown values, and flash_attention_2 where it cannot run, are refused in
one line naming the knob, the reason and the fix; what can run passes (a warning where shared_prefix goes off)."""

from __future__ import annotations

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.engines import attn_impl
from areal_cli.errors import ConfigError

GPU = ["cluster=gpu_2x8", "allocation_mode=sglang:d4+fsdp:d4"]
MEGATRON_GPU = ["engine=megatron", "allocation_mode=sglang.d4+d2t2p2", "cluster=gpu_2x8"]


def err(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(load_config(list(overrides)))
    return info.value


@pytest.mark.parametrize("value", ["flash", "flash_attention_3", "SDPA", ""])
def test_unknown_value_is_refused(value):
    e = err(f"engine.attn_impl={value}")
    assert e.path == "engine.attn_impl" and f"unknown value '{value}'" in e.reason
    assert "sdpa, eager, flash_attention_2" in e.hint
    assert "\n" not in str(e)


@pytest.mark.parametrize("engine", [[], MEGATRON_GPU[:2]])
@pytest.mark.parametrize("value", ["sdpa", "eager"])
def test_sdpa_and_eager_pass_on_every_engine(value, engine):
    cfg = load_config([*engine, f"engine.attn_impl={value}"] + (["cluster=gpu_2x8"] if engine else []))
    validate(cfg)


def test_flash_without_flash_attn_is_refused(monkeypatch):
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: False)
    e = err(*GPU, "engine.attn_impl=flash_attention_2")
    assert e.path == "engine.attn_impl" and "flash_attn package" in e.reason and "engine.attn_impl=sdpa" in e.hint
    # the same config passes once the package is there: the refusal is about the package
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: True)
    plan = validate(load_config([*GPU, "engine.attn_impl=flash_attention_2"]))
    assert any("engine.shared_prefix is off" in w for w in plan.warnings)
    plan = validate(load_config([*GPU, "engine.attn_impl=flash_attention_2", "engine.shared_prefix=false"]))
    assert not any("shared_prefix" in w for w in plan.warnings)


def test_flash_attn_really_is_missing_here():
    """This environment has no flash_attn (CPU torch): the real package check refuses it."""
    if attn_impl.flash_attn_installed():
        pytest.skip("flash_attn is installed here")
    assert "flash_attn package" in err(*GPU, "engine.attn_impl=flash_attention_2").reason


def test_flash_on_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: True)
    e = err("engine.attn_impl=flash_attention_2")  # the embedded CPU default
    assert e.path == "engine.attn_impl" and "CUDA" in e.reason and "cluster.device=cuda" in e.hint


def test_megatron_flash_needs_transformer_engine(monkeypatch):
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: True)
    monkeypatch.setattr(attn_impl, "transformer_engine_installed", lambda: False)
    e = err(*MEGATRON_GPU, "engine.attn_impl=flash_attention_2")
    assert e.path == "engine.attn_impl" and "TransformerEngine" in e.reason and "eager" in e.hint
    monkeypatch.setattr(attn_impl, "transformer_engine_installed", lambda: True)
    # TE's flash kernel takes no fp32: the run has to compute in bf16
    e = err(*MEGATRON_GPU, "engine.attn_impl=flash_attention_2")
    assert "fp32" in e.reason and "engine.dtype=bfloat16" in e.hint
    plan = validate(load_config([*MEGATRON_GPU, "engine.attn_impl=flash_attention_2", "engine.dtype=bfloat16"]))
    assert not any("shared_prefix" in w for w in plan.warnings)  # megatron has no shared-prefix packing


@pytest.mark.parametrize("engine,path,value,choices", [
    ("fsdp", "engine.grad_reduce", "per_step", "per_micro_batch, last_micro_batch"),
    ("megatron", "engine.megatron.recompute_granularity", "partial", "selective, full"),
])
def test_other_engine_choices_are_refused_by_validate_config(engine, path, value, choices):
    """Checked before anything starts, not only when the engine is built."""
    e = err(f"engine={engine}", f"{path}={value}")
    assert e.path == path and f"unknown value '{value}'" in e.reason and choices in e.hint


def test_tied_head_choices_and_engines():
    """engine.tied_head: an unknown mode, 'sharded' on an engine without the row-sharded table and 'sharded'
    under archon's pipeline stages or deepspeed's ZeRO-1/2 and offload are refused before anything starts;
    fsdp, archon and deepspeed's ZeRO-3 take every mode."""
    e = err("engine.tied_head=rows")
    assert e.path == "engine.tied_head" and "auto, sharded, gathered" in e.hint
    for mode in ("auto", "sharded", "gathered"):
        validate(load_config([f"engine.tied_head={mode}"]))
        validate(load_config(["engine=archon", "allocation_mode=hf:d1+archon:d1t2", "cluster.n_gpus_per_node=3",
                              f"engine.tied_head={mode}"]))
    e = err("engine=archon", "allocation_mode=hf:d1+archon:d1p2", "cluster.n_gpus_per_node=3",
            "engine.tied_head=sharded")
    assert e.path == "engine.tied_head" and "p2" in e.reason and "drop p" in e.hint
    e = err("engine=megatron", "engine.tied_head=sharded")
    assert e.path == "engine.tied_head" and "fsdp" in e.reason and "engine=megatron" in e.hint
    validate(load_config(["engine=megatron", "engine.tied_head=gathered"]))
    # deepspeed keeps the table out of ZeRO-3 (engines/zero3_table.py): not under ZeRO-1/2 or offload
    for mode in ("auto", "sharded", "gathered"):
        validate(load_config(["engine=deepspeed", f"engine.tied_head={mode}"]))
    for knob in ("engine.deepspeed.zero_stage=2", "engine.deepspeed.offload_optimizer=true"):
        e = err("engine=deepspeed", "engine.tied_head=sharded", knob)
        assert e.path == "engine.tied_head" and "ZeRO-3" in e.reason and "zero_stage=3" in e.hint, knob
