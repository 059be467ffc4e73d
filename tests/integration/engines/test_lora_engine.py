"""LoRA in the training engines (peft adapters), with real gloo worker processes.

A LoRA ``train_batch`` at d2 equals d1 (fsdp, archon, deepspeed ZeRO-3; archon also at p2), fp32 1e-5; the base
weights are bit-unchanged after training; the optimizer holds the adapter only; the KL reference (adapter
disabled) equals the base model; the merged HF export reproduces the policy in plain transformers and
peft's own loader reads the adapter written beside it; a DCP checkpoint holds the adapter and optimizer
only and resumes to the same adapter, bit for bit. fsdp d1/d2 run by default; archon and deepspeed under
``-m slow`` (one more two-process launch): ``pytest -m slow tests/integration/engines/test_lora_engine.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

TOL = 1e-5
LORA = {"rank": 4, "alpha": 8.0}
STEPS = 3


SCRIPT = str(SUPPORT / "lora_worker.py")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """fsdp d1 (with export, checkpoints, a resume) and d2; the other engines' layouts are ``others``."""
    out = tmp_path_factory.mktemp("lora_runs")
    w1 = [{"name": "d1", "lora": LORA, "steps": STEPS, "export": str(out / "export"),
           "save": str(out / "ckpt_d1")},
          {"name": "d1_half", "lora": LORA, "steps": 1, "save": str(out / "ckpt_half")},
          {"name": "d1_resumed", "lora": LORA, "start": 1, "steps": STEPS, "load": str(out / "ckpt_half")},
          {"name": "full", "steps": 1}]
    w2 = [{"name": "d2", "lora": LORA, "steps": STEPS, "parallel": {"dp": 2}}]
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": w1}, 1, script=SCRIPT, timeout=600)
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": w2}, 2, script=SCRIPT, timeout=600)
    res = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    res["_dir"] = out
    return res


@pytest.fixture(scope="module")
def others(tiny_model_dir, tmp_path_factory):
    """archon d2 and p2, deepspeed ZeRO-3 d2 (slow: one more launch of two processes)."""
    out = tmp_path_factory.mktemp("lora_runs_others")
    w2 = [{"name": "archon_d2", "cls": "archon", "lora": LORA, "steps": STEPS, "parallel": {"dp": 2}},
          {"name": "archon_p2", "cls": "archon", "lora": LORA, "steps": STEPS, "parallel": {"pp": 2}},
          {"name": "ds_z3_d2", "cls": "deepspeed", "lora": LORA, "steps": STEPS, "parallel": {"dp": 2},
           "engine": {"deepspeed": {"zero_stage": 3}}, "save": str(out / "ckpt_ds")}]
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": w2}, 2, script=SCRIPT, timeout=900)
    res = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    res["_dir"] = out
    return res


def _run(request, runs, name):
    return runs[name] if name in runs else request.getfixturevalue("others")[name]


SLOW_LAYOUTS = [pytest.param(n, marks=pytest.mark.slow) for n in ("archon_d2", "archon_p2", "ds_z3_d2")]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("other", ["d2", *SLOW_LAYOUTS])
def test_layouts_equal_d1(request, runs, other):
    ref, run = runs["d1"], _run(request, runs, other)
    for s_ref, s in zip(ref["stats"], run["stats"], strict=True):
        assert abs(s_ref["loss"] - s["loss"]) <= TOL
        assert abs(s_ref["grad_norm"] - s["grad_norm"]) <= TOL * max(1.0, s_ref["grad_norm"])
    assert _max_diff(ref["adapter"], run["adapter"]) <= TOL
    assert (ref["logp_after"] - run["logp_after"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["d1", "d2", *SLOW_LAYOUTS])
def test_base_bit_unchanged_and_adapter_moved(request, runs, name):
    r = _run(request, runs, name)
    assert r["base_before"].keys() == r["base_after"].keys() and r["base_before"]
    for k in r["base_before"]:
        assert torch.equal(r["base_before"][k], r["base_after"][k]), f"{name}: base weight {k} changed"
    assert any(v.abs().max() > 0 for k, v in r["adapter"].items() if "lora_B" in k), "lora_B never moved"
    assert (r["logp_after"] - r["logp_before"]).abs().max().item() > 1e-3, "the policy did not change"


def test_optimizer_holds_adapter_only(runs):
    r = runs["d1"]
    assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
    assert r["optim_params"] == len(r["trainable"]) == len(r["adapter"])
    assert r["optim_numel"] == sum(t.numel() for t in r["adapter"].values())
    # 2 layers × 7 projections × rank 4 × (in + out): far below the model's parameter count.
    assert r["optim_numel"] < sum(t.numel() for t in r["base_before"].values()) / 10


def test_reference_is_base_with_adapter_off(runs):
    """The KL reference after training equals the untouched base model's logprobs (the full-FT run's
    logprobs before its first step), and differs from the trained policy's."""
    r = runs["d1"]
    base = runs["full"]["logp_before"]
    assert (r["ref_logp"] - base).abs().max().item() <= TOL
    assert (r["ref_logp"] - r["logp_after"]).abs().max().item() > 1e-3


def test_merged_export_loads_in_transformers_and_peft(runs, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from areal_cli.weight_sync.adapter_files import ADAPTER_SUBDIR

    export = runs["_dir"] / "export"
    assert not any(".lora_" in k or "base_layer" in k for k in _keys(export)), "not a plain HF model"
    b = runs["d1"]["batch"]
    merged = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(export / ADAPTER_SUBDIR)).eval()
    want = runs["d1"]["logp_after"]
    for model in (merged, peft_model):
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"].long()).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        m = b["attention_mask"][:, 1:]
        assert ((lp - want[:, 1:]) * m).abs().max().item() <= 1e-4


def _keys(d: Path) -> list[str]:
    from safetensors import safe_open

    out = []
    for f in d.glob("model*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out += list(h.keys())
    return out


def test_checkpoint_holds_adapter_and_optimizer_only_and_resumes_exactly(runs):
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(runs["_dir"] / "ckpt_d1")).read_metadata()
    model_keys = [k for k in md.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert any(k.startswith("optim.") for k in md.state_dict_metadata)
    a, b = runs["d1"]["adapter"], runs["d1_resumed"]["adapter"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed adapter differs"


@pytest.mark.slow
def test_deepspeed_checkpoint_excludes_the_frozen_base(others):
    from areal_cli.engines.deepspeed import CHECKPOINT_TAG

    runs = others
    files = list((runs["_dir"] / "ckpt_ds" / CHECKPOINT_TAG).glob("*model_states.pt"))
    assert files
    for f in files:
        module = torch.load(f, weights_only=False, map_location="cpu")["module"]
        base = {k: v.numel() for k, v in module.items() if ".lora_A." not in k and ".lora_B." not in k}
        # exclude_frozen_parameters drops the frozen base; a tied alias (lm_head) may stay as an empty
        # ZeRO-3 placeholder, which holds no data.
        assert module and sum(base.values()) == 0, base
    optim = sum(t.numel() for f in (runs["_dir"] / "ckpt_ds" / CHECKPOINT_TAG).glob("*optim_states.pt")
                for t in _tensors(torch.load(f, weights_only=False, map_location="cpu")))
    n_adapter = sum(t.numel() for t in runs["ds_z3_d2"]["adapter"].values())
    assert optim < 10 * n_adapter, (optim, n_adapter)  # fp32 partitions + Adam moments of the adapter only


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
