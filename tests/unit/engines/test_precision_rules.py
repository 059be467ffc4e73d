"""engines/precision.py: what ``engine.dtype`` resolves to, the fp32 head, and the one-line refusals
(``float16``, the retired ``engine.mixed_precision``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.engines import precision
from areal_cli.errors import ConfigError


def test_resolve_trained_models_keep_fp32_masters():
    p = precision.resolve("bfloat16", trainable=True)
    assert (p.compute, p.params, p.mixed) == (torch.bfloat16, torch.float32, True)
    p = precision.resolve("bf16", trainable=False)  # a reference model: nothing to update, bf16 weights
    assert (p.compute, p.params, p.mixed) == (torch.bfloat16, torch.bfloat16, False)
    p = precision.resolve("float32", trainable=True)
    assert (p.compute, p.params, p.mixed) == (torch.float32, torch.float32, False)


@pytest.mark.parametrize("name", ["float16", "fp16", "half"])
def test_float16_is_refused_with_the_reason(name):
    with pytest.raises(ConfigError) as info:
        precision.resolve(name, trainable=True)
    e = info.value
    assert e.path == "engine.dtype" and "loss scal" in e.reason and "engine.dtype=bfloat16" in e.hint


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError) as info:
        precision.dtype_name("int8")
    assert "unknown dtype" in info.value.reason


def test_validate_config_refuses_float16_and_the_retired_knob_in_one_line():
    for overrides, path, words in ((["engine.dtype=float16"], "engine.dtype", "loss scal"),
                                   (["engine.mixed_precision=true"], "engine.mixed_precision", "folded into")):
        with pytest.raises(ConfigError) as info:
            validate(load_config(overrides))
        e = info.value
        assert e.path == path and words in e.reason and "engine.dtype=bfloat16" in e.hint, e
        assert "\n" not in str(e)
    validate(load_config(["engine.dtype=bfloat16"]))  # the knob that is meant passes


def test_fp32_head_computes_logits_in_fp32_from_bf16_weights():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False).to(torch.bfloat16)
    x = (torch.randn(5, 64) * 3).to(torch.bfloat16)
    exact = F.linear(x.float(), head.weight.float())
    plain = head(x)
    assert plain.dtype == torch.bfloat16 and (plain.float() - exact).abs().max() > 1e-3  # what bf16 logits lose
    precision.fp32_head(head)
    out = head(x)
    assert out.dtype == torch.float32 and torch.equal(out, exact)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one fsdp rank runs its forward under autocast
        assert torch.equal(head(x.float()), exact)
    out.sum().backward()
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.bfloat16


def test_fp32_head_survives_copies_and_leaves_other_forwards_alone():
    head = precision.fp32_head(torch.nn.Linear(8, 4).to(torch.bfloat16))
    twin = copy.deepcopy(head)  # archon's pipeline copies modules: the copy must use its own weights
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    x = torch.randn(2, 8)
    assert torch.equal(twin(x), torch.zeros(2, 4)) and head(x).abs().sum() > 0
    assert precision.fp32_head(head) is head and type(head).__name__ == "FP32Linear"  # idempotent

    class Adapter(torch.nn.Linear):  # a layer with its own forward (e.g. a LoRA-wrapped head) is not replaced
        def forward(self, x):
            return super().forward(x) * 2

    a = Adapter(8, 4)
    assert type(precision.fp32_head(a)) is Adapter
