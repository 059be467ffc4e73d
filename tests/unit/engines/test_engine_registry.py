"""The engine registry is the one place a backend is described: parser, validator, estimator and
trainer all read it, so validate-config accepts exactly what an engine runs."""

from __future__ import annotations

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.engines import ENGINE_SPECS, get_engine_cls, get_engine_spec
from areal_cli.errors import ConfigError

GPU = ["cluster=gpu_1x8", "model=qwen2_5_1_5b"]


def test_validation_follows_the_registry_dims():
    with pytest.raises(ConfigError, match="fsdp does not support tensor parallelism"):
        validate(load_config(GPU + ["allocation_mode=sglang:d4+fsdp:d1t2"]))
    for letter in "dtpce":
        ok = letter in ENGINE_SPECS["fsdp"].dims or letter == "d"
        spec = f"sglang:d2+fsdp:d{2 if letter != 'd' else 4}" + ("" if letter == "d" else f"{letter}2")
        if ok:
            validate(load_config(GPU + [f"allocation_mode={spec}"]))
        else:
            with pytest.raises(ConfigError):
                validate(load_config(GPU + [f"allocation_mode={spec}"]))


def test_memory_model_comes_from_the_registry():
    def train_gb(*ov):
        return validate(load_config(GPU + ["algo.batch_size=8", *ov])).train.memory

    z1 = train_gb("allocation_mode=sglang:d4+deepspeed:d4", "engine.deepspeed.zero_stage=1")
    z3 = train_gb("allocation_mode=sglang:d4+deepspeed:d4", "engine.deepspeed.zero_stage=3")
    assert z3.weights_gb < z1.weights_gb and z3.grads_gb < z1.grads_gb and z3.optim_gb == z1.optim_gb
    d1 = train_gb("allocation_mode=sglang:d4+archon:d1")
    t2 = train_gb("allocation_mode=sglang:d4+archon:d1t2")
    assert t2.params_per_device * 2 == pytest.approx(d1.params_per_device, rel=1e-6)


def test_another_engines_section_is_an_error_not_ignored():
    with pytest.raises(ConfigError) as info:
        validate(load_config(GPU + ["allocation_mode=sglang:d4+fsdp:d4", "engine.deepspeed.zero_stage=2"]))
    assert info.value.path == "engine.deepspeed.zero_stage" and "engine=deepspeed" in info.value.hint
    validate(load_config(GPU + ["allocation_mode=sglang:d4+deepspeed:d4", "engine.deepspeed.zero_stage=2"]))


def test_planned_and_unknown_engines_are_named(monkeypatch):
    from areal_cli.engines import FULL_SHARD, EngineSpec

    monkeypatch.setitem(ENGINE_SPECS, "planned", EngineSpec("planned", None, "d", lambda _: FULL_SHARD))
    with pytest.raises(ConfigError, match="cannot train in this release"):
        get_engine_cls("planned")
    with pytest.raises(ConfigError, match="did you mean 'fsdp'"):
        get_engine_spec("fsdq")
    with pytest.raises(ConfigError, match="cannot import the training engine"):
        get_engine_spec("no_such_pkg.mod:Engine")
    with pytest.raises(ConfigError, match="is not a TrainEngine subclass"):
        get_engine_spec("collections:OrderedDict")


def test_import_path_engine_declares_its_dims(monkeypatch, tmp_path):
    (tmp_path / "my_engine.py").write_text(
        "from areal_cli.engines.fsdp import FSDPEngine\n"
        "class MyEngine(FSDPEngine):\n    '''An FSDP variant.'''\n    dims = 'dc'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = get_engine_spec("my_engine:MyEngine")
    assert spec.trainable and spec.dims == "dc" and spec.summary == "An FSDP variant."
    validate(load_config(["allocation_mode=hf:d1+d1c2", "cluster.n_gpus_per_node=3", "engine.name=my_engine:MyEngine"]))
    with pytest.raises(ConfigError, match="does not support tensor parallelism"):
        validate(load_config(["allocation_mode=hf:d1+d1t2", "cluster.n_gpus_per_node=3",
                              "engine.name=my_engine:MyEngine"]))


ARCHON = ["engine=archon", "cluster.n_gpus_per_node=5"]


@pytest.mark.parametrize("spec,extra,path,needle", [
    ("hf:d1+archon:d1p3", [], "allocation_mode.spec", "3 pipeline stages for 2 layers"),
    ("hf:d1+archon:d1p2", ["engine.archon.pp_schedule=ZeroBubble"], "engine.archon.pp_schedule", "unknown"),
    ("hf:d1+archon:d1p2", ["engine.archon.pp_schedule=Interleaved1F1B"], "engine.archon.pp_virtual_stages",
     "at least 2"),
    ("hf:d1+archon:d1p2", ["engine.archon.pp_virtual_stages=2"], "engine.archon.pp_virtual_stages",
     "one stage per rank"),
    ("hf:d1+archon:d1p2", ["engine.archon.pp_layers=[2,1]"], "engine.archon.pp_layers", "summing to"),
    ("hf:d1+fsdp:d2", ["engine.archon.pp_schedule=GPipe"], "engine.archon.pp_schedule", "engine=fsdp does not read"),
])
def test_validate_refuses_what_archon_cannot_run(spec, extra, path, needle):
    with pytest.raises(ConfigError) as info:
        validate(load_config(ARCHON[1:] + [f"allocation_mode={spec}", *extra]))
    assert info.value.path == path and needle in str(info.value), str(info.value)


def test_validate_accepts_what_archon_runs():
    for spec, extra in (("hf:d1+archon:d1p2", ["engine.archon.pp_layers=[0,2]"]),
                        ("hf:d1+archon:d2t2", []), ("hf:d1+archon:d1t2c2", []), ("hf:d1+archon:d1p2c2", [])):
        validate(load_config(ARCHON[1:] + [f"allocation_mode={spec}", *extra]))


def test_megatron_refuses_what_it_cannot_run():
    """c needs TransformerEngine's attention; virtual stages need p and must divide the layers (28 here)."""
    with pytest.raises(ConfigError, match="TransformerEngine"):
        validate(load_config(GPU + ["allocation_mode=sglang:d4+megatron:d2c2"]))
    with pytest.raises(ConfigError, match="virtual stages need pipeline parallelism") as info:
        validate(load_config(GPU + ["allocation_mode=sglang:d4+megatron:d2t2", "engine.megatron.virtual_stages=2"]))
    assert info.value.path == "engine.megatron.virtual_stages"
    with pytest.raises(ConfigError, match="does not divide num_hidden_layers=28"):
        validate(load_config(GPU + ["allocation_mode=sglang:d4+megatron:d1p2t2", "engine.megatron.virtual_stages=3"]))
    validate(load_config(GPU + ["allocation_mode=sglang:d4+megatron:d1p2t2", "engine.megatron.virtual_stages=2"]))
    assert get_engine_spec("megatron").trainable
