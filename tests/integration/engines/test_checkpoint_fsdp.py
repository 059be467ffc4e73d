"""save → SIGKILL → load → continue is bit-identical to an uninterrupted run (dp2, gloo).

Also: the HF export loads in transformers and gives the engine's logprobs.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from fsdp_worker import launch
from support_paths import SUPPORT

OPTIM = {"lr": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "weight_decay": 0.01, "grad_clip": 0.5}
ENGINE = {"max_tokens_per_mb": 40}


def test_resume_is_bit_identical(tiny_model_dir, tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    common = {"engine": ENGINE, "optim": OPTIM, "parallel": {"dp": 2}, "total_steps": 5}
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": [
        {"name": "full", "steps": 5, **common},
        {"name": "first", "steps": 2, "save": str(ckpt), "kill_after": True, **common},
    ]}, 2, expect_kill=True)
    assert (ckpt / "extra_rank0.pt").is_file() and (ckpt / "extra_rank1.pt").is_file()
    launch({"model_dir": tiny_model_dir, "out": str(out), "variants": [
        {"name": "resumed", "start": 2, "steps": 5, "load": str(ckpt), **common},
    ]}, 2)
    full = torch.load(out / "full.pt", weights_only=False)
    first = torch.load(out / "first.pt", weights_only=False)
    resumed = torch.load(out / "resumed.pt", weights_only=False)
    # The scheduler resumed too: the LR of step 3 is the uninterrupted run's, not warmup restarting.
    assert [s["lr"] for s in resumed["stats"]] == [s["lr"] for s in full["stats"][2:]]
    assert [s["loss"] for s in resumed["stats"]] == [s["loss"] for s in full["stats"][2:]]
    moved = False
    for k, w in full["weights"].items():
        assert torch.equal(w, resumed["weights"][k]), f"{k} differs after resume"
        moved |= not torch.equal(w, first["weights"][k])
    assert moved, "the last 3 steps changed nothing; the comparison would be vacuous"


@pytest.mark.slow  # the weight-sync test also loads every HF export in transformers (greedy check)
def test_hf_export_loads_in_transformers(tiny_model_dir, tmp_path):
    script = tmp_path / "export.py"
    export = tmp_path / "hf"
    script.write_text(f"""
import torch
from areal_cli.utils.dist import init_distributed
from areal_cli.engines.fsdp import FSDPEngine
from areal_cli.config.engine import EngineConfig
from areal_cli.config.algo import OptimConfig
from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta
import sys; sys.path.insert(0, {str(SUPPORT)!r})
from fsdp_worker import make_batch, loss_fn, loss_weight_fn
init_distributed("gloo")
e = FSDPEngine(EngineConfig(), OptimConfig(lr=1e-2), total_steps=2, seed=0)
e.initialize(ParallelStrategy(), {tiny_model_dir!r})
e.train_batch(make_batch(0), loss_fn, loss_weight_fn)
e.save(SaveLoadMeta(path={str(export)!r}, weight_format="hf"))
torch.save(e.forward(make_batch(1))["logprobs"], {str(tmp_path / "lp.pt")!r})
""")
    import subprocess

    # A process group made earlier in this pytest process left RANK/MASTER_PORT in os.environ; the
    # child must start its own one-process group, not join that one's port.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    subprocess.run([sys.executable, str(script)], check=True, timeout=300, capture_output=True, env=env)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(str(export))
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    AutoTokenizer.from_pretrained(str(export))
    sys.path.insert(0, str(SUPPORT))
    from fsdp_worker import make_batch

    b = make_batch(1)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"].long()).logits
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, b["input_ids"][:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], 1) * b["attention_mask"]
    expected = torch.load(tmp_path / "lp.pt")
    assert (lp - expected).abs().max().item() < 1e-4
