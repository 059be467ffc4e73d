"""megatron-core groundwork: HF -> mcore -> HF bit-exact and mcore forward logits = HF's (fp32, 1e-5) for
dense Qwen2 (tied), Qwen3 (q/k norms, head_dim ≠ hidden/heads) and Llama, under TP1PP1, TP2, PP2, TP2PP2
and PP2 with two virtual stages (4 gloo processes; one launch re-initialises mcore's model parallel state
per layout). Skips when megatron-core 0.16.1 is not installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

from areal_cli.engines.megatron import compat  # noqa: E402

FAMILIES = ["qwen2", "qwen3", "llama"]
LAYOUTS = {"t1p1v1": {"t": 1, "p": 1}, "t2p1v1": {"t": 2, "p": 1}, "t1p2v1": {"t": 1, "p": 2},
           "t2p2v1": {"t": 2, "p": 2}, "t1p2v2": {"t": 1, "p": 2, "v": 2}}
TOL = 1e-5

needs_mcore = pytest.mark.skipif(compat.installed_version() != compat.SUPPORTED_VERSION,
                                 reason=f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                                        "(scripts/install_test_deps.sh installs it)")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore_convert")
    launch({"mode": "convert", "out": str(out), "families": FAMILIES, "layouts": list(LAYOUTS.values())}, 4,
           timeout=600, script=str(SUPPORT / "megatron_worker.py"))
    return json.loads((out / "result.json").read_text())


@needs_mcore
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_bit_exact(results, layout, family):
    r = results[layout][family]
    assert r["missing"] == [] and r["extra"] == [], r
    assert r["not_equal"] == [], f"{layout} {family}: HF -> mcore -> HF changed {r['not_equal']}"


@needs_mcore
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_logits_match_hf(results, layout, family):
    r = results[layout][family]
    lay = LAYOUTS[layout]
    # every last-stage rank (t ranks × data-parallel replicas) compared its gathered logits
    assert r["logit_ranks"] == 4 // lay["p"], r
    assert r["logits_max_diff"] <= TOL, f"{layout} {family}: max |logits - HF| = {r['logits_max_diff']}"


def _cfg(model_type: str, **kw):
    from types import SimpleNamespace

    base = dict(model_type=model_type, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, vocab_size=128, rms_norm_eps=1e-6,
                max_position_embeddings=64, hidden_act="silu", rope_parameters={"rope_theta": 1e4})
    return SimpleNamespace(**{**base, **kw})


def test_unsupported_family_names_the_supported_ones():
    from areal_cli.engines.megatron.model import SUPPORTED_FAMILIES, UnsupportedModelError, hf_arch

    with pytest.raises(UnsupportedModelError) as e:
        hf_arch(_cfg("gpt2"))
    for fam in SUPPORTED_FAMILIES:
        assert fam in str(e.value)
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        hf_arch(_cfg("llama", attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        hf_arch(_cfg("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    a = hf_arch(_cfg("qwen3", head_dim=24, tie_word_embeddings=False))
    assert (a.qk_norm, a.qkv_bias, a.head_dim, a.tied) == (True, False, 24, False)
    assert hf_arch(_cfg("qwen2", tie_word_embeddings=True)).qkv_bias


def test_layout_the_shapes_cannot_split_is_a_config_error():
    from areal_cli.engines.megatron.model import check_layout, hf_arch
    from areal_cli.errors import ConfigError

    arch = hf_arch(_cfg("llama"))
    with pytest.raises(ConfigError, match="t4 does not divide num_key_value_heads=2"):
        check_layout(arch, tp=4, pp=1)
    with pytest.raises(ConfigError, match="virtual stages"):
        check_layout(arch, tp=1, pp=2, vpp=3)
    check_layout(arch, tp=2, pp=2, vpp=2)


def test_megatron_package_imports_neither_torch_nor_megatron():
    code = ("import sys; import areal_cli.engines.megatron.model, areal_cli.engines.megatron.convert, "
            "areal_cli.engines.megatron.compat; "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


