"""LoRA pieces that need no process: config presets and validation, the memory estimate, the adapter
payloads of each backend, the trainer-side merge against peft's own, the server's fused form."""

from __future__ import annotations

import pytest
import torch

from areal_cli.plan.compose import load_config
from areal_cli.config.model import LORA_PRESETS, lora_target_modules
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError


def test_presets_and_target_modules():
    assert lora_target_modules("auto", "qwen2") == LORA_PRESETS["all"]
    assert lora_target_modules("auto", "qwen3_moe") == LORA_PRESETS["attention"]
    assert lora_target_modules("auto", None, moe=True) == LORA_PRESETS["attention"]
    assert lora_target_modules("mlp") == ("gate_proj", "up_proj", "down_proj")
    assert lora_target_modules("q_proj, v_proj") == ("q_proj", "v_proj")
    with pytest.raises(ConfigError) as e:
        lora_target_modules("q_proj,lm_head")
    assert e.value.path == "model.lora.target_modules" and "lm_head" in e.value.reason


@pytest.mark.parametrize("overrides, path, words", [
    (["model.lora.rank=8", "engine=megatron"], "model.lora.rank", "fsdp, archon"),
    (["model.lora.rank=8", "engine=archon", "allocation_mode=hf:d1+d1t2", "cluster.n_gpus_per_node=3"],
     "model.lora.rank", "tensor parallelism"),
    (["model.lora.rank=8", "model.lora.target_modules=embed"], "model.lora.target_modules", "embed"),
    (["model.lora.rank=8", "algo=sft"], "algo.name", "algo=sft"),
    (["model.lora.rank=-1"], "model.lora.rank", "out of range"),
    (["model.lora.rank=8", "model.lora.dropout=1.0"], "model.lora.dropout", "out of range"),
])
def test_validation_errors(overrides, path, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(overrides))
    assert e.value.path == path and words in e.value.reason


def test_memory_estimate_counts_optimizer_for_adapter_only():
    # bf16 (a real model's default) adds fp32 masters; an explicit budget, as auto refuses 7B on this CPU cluster
    fp32 = ["model=qwen2_5_7b", "engine.dtype=float32", "engine.max_tokens_per_mb=4096"]
    full = validate(load_config(fp32)).trains[0].memory
    lora = validate(load_config([*fp32, "model.lora.rank=16"])).trains[0].memory
    attn = validate(load_config([*fp32, "model.lora.rank=16",
                                 "model.lora.target_modules=attention"])).trains[0].memory
    # Qwen2.5-7B, r=16 on all 7 projections: 28 layers × 16 × Σ(in+out) ≈ 40.4M adapter parameters.
    h, q, kv, i, layers, r = 3584, 3584, 512, 18944, 28, 16
    n = layers * r * ((h + q) * 2 + (h + kv) * 2 + 3 * (h + i))
    assert lora.optim_gb == pytest.approx(n * 8 / 2**30, rel=1e-6)  # fp32 Adam m and v
    assert lora.optim_gb < full.optim_gb / 100 and attn.optim_gb < lora.optim_gb
    assert lora.grads_gb < full.grads_gb / 100
    assert lora.weights_gb >= full.weights_gb  # the frozen base stays, plus the adapter


def test_backend_payloads():
    """The order and values of each backend's adapter calls. That vLLM's routes and request models take
    them (and the launcher's LoRA flags and environment) is checked against vLLM's own code by
    tests/integration/inference/test_vllm_contract.py (vllm venv), and for real by test_vllm_sync.py."""
    from areal_cli.api.io_struct import GenerationConfig, ParamSpec, WeightUpdateMeta
    from areal_cli.inference.backends import hf, sglang, vllm

    v = vllm.build_load_lora("p", "/a/v3", 3, loaded=True)
    assert [c.path for c in v] == ["/pause", "/v1/unload_lora_adapter", "/v1/load_lora_adapter",
                                   "/reset_prefix_cache", "/update_weight_version", "/resume"]
    assert v[1].json == {"lora_name": "p"} and v[2].json == {"lora_name": "p", "lora_path": "/a/v3"}
    assert v[4].json == {"new_version": "3"}
    assert "/v1/unload_lora_adapter" not in [c.path for c in vllm.build_load_lora("p", "/a", 1, loaded=False)]
    assert vllm.build_generate([1], GenerationConfig(), model="p").json["model"] == "p"  # the adapter by name
    s = sglang.build_load_lora("p", "/a/v3", 3, loaded=True)
    assert [c.path for c in s] == ["/pause_generation", "/unload_lora_adapter", "/load_lora_adapter",
                                   "/update_weight_version", "/continue_generation"]
    assert sglang.build_generate([1], GenerationConfig(), lora="p").json["lora_path"] == "p"
    assert "lora_path" not in sglang.build_generate([1], GenerationConfig()).json
    (h,) = hf.build_load_lora("p", "/a/v3", 3, loaded=True)
    assert h.json == {"lora_name": "p", "lora_path": "/a/v3", "replace": True, "weight_version": "3"}
    d = hf.build_load_lora_distributed(WeightUpdateMeta(type="distributed", version=4, group_name="g"), "p",
                                       {"r": 2}, [ParamSpec("x.lora_A.default.weight", "float32", [2, 8])])
    assert d.path == "/load_lora_adapter_from_distributed" and d.json["weight_version"] == "4"
    assert d.json["shapes"] == [[2, 8]] and d.json["load_format"] == "flattened_bucket"


def _tiny_peft(d: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_PRESETS["all"]))
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return d, peft_model


def test_merged_stream_equals_peft_merge(tiny_model_dir):
    """engines/lora.merged_stream over an injected model's state dict = peft's merge_and_unload."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from areal_cli.engines import lora as L

    d, peft_model = _tiny_peft(tiny_model_dir)
    ours = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    pc = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_PRESETS["all"]))
    inject_adapter_in_model(pc, ours)
    src = {k.replace("base_model.model.", ""): v for k, v in peft_model.state_dict().items()}
    ours.load_state_dict(src)
    merged = dict(L.merged_stream(iter(ours.state_dict().items()), pc))
    want = peft_model.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert max((merged[k] - want[k]).abs().max().item() for k in want) < 1e-6


def test_fused_fast_path_form_equals_per_projection(tiny_model_dir):
    """The fast path's fused (Aᵀ, Bᵀ) per layer, applied to x, equals each projection's own x·Aᵀ·Bᵀ·s."""
    from transformers import AutoModelForCausalLM

    from areal_cli.inference.server import lora as SL

    d, peft_model = _tiny_peft(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    tensors = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    cfg = {"r": 4, "lora_alpha": 8, "peft_type": "LORA"}
    for k in list(tensors):  # peft's saved keys drop the adapter name
        tensors[k.replace(".default", "")] = tensors.pop(k)
    plain = SL.build_adapter(base, "a", "-", cfg, tensors, 64)
    fused = SL.fused_layers(plain, base, q_scale=0.5)
    x = torch.randn(3, base.config.hidden_size)
    a, b = plain.modules["model.layers.1.self_attn.q_proj"], plain.modules["model.layers.1.self_attn.v_proj"]
    got = torch.zeros(3, fused[1]["qkv"][1].shape[1])
    SL.add_delta(got, x, *fused[1]["qkv"], None)
    q_out = a[1].shape[0]
    kv = base.model.layers[1].self_attn.k_proj.weight.shape[0]
    assert torch.allclose(got[:, :q_out], 0.5 * (x @ a[0].t() @ a[1].t()), atol=1e-6)
    assert torch.allclose(got[:, q_out + kv:], x @ b[0].t() @ b[1].t(), atol=1e-6)
    # row groups: only the indexed rows get the term
    out = torch.zeros(3, got.shape[1])
    SL.add_delta(out, x, *fused[1]["qkv"], torch.tensor([2]))
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.allclose(out[2], got[2], atol=1e-6)


def test_flat_pack_matches_the_receivers_layout_and_nan_is_refused(tiny_model_dir):
    """The adapter's one-broadcast buffer holds each tensor where the server's flat_layout reads it
    (one dtype and mixed dtypes); an adapter with a NaN is refused by the server-side check."""
    from transformers import AutoModelForCausalLM

    from areal_cli.inference.server import lora as SL
    from areal_cli.inference.server.weights import flat_layout
    from areal_cli.weight_sync.lora import flat_pack

    g = torch.Generator().manual_seed(0)
    for dtypes in ([torch.float32] * 3, [torch.float32, torch.bfloat16, torch.float32]):
        t = {f"t{i}": torch.randn(3, 5 + i, generator=g).to(d) for i, d in enumerate(dtypes)}
        specs, buf = flat_pack(t)
        slots, nbytes = flat_layout([s.dtype for s in specs], [s.shape for s in specs])
        assert buf.numel() == nbytes
        for s, (d, off, k) in zip(specs, slots):
            assert torch.equal(buf[off:off + k * d.itemsize].view(d).view(s.shape), t[s.name])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    w = model.model.layers[0].self_attn.q_proj.weight
    a, b = torch.randn(2, w.shape[1], generator=g), torch.randn(w.shape[0], 2, generator=g)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    cfg = {"r": 2, "lora_alpha": 4, "peft_type": "LORA"}
    assert SL.build_adapter(model, "ok", "-", cfg, {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, 8)
    b[0, 0] = float("nan")
    with pytest.raises(SL.AdapterRejected, match="non-finite"):
        SL.build_adapter(model, "nan", "-", cfg, {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, 8)
