"""What the ``gpu``-marked tests share (scripts/gpu_check.sh runs them; docs/gpu_check.md): the device
they run on, the skip without CUDA, and where they leave results for the person who ran the check.

``AREAL_GPU_CHECK_REHEARSE=cpu`` runs the same tests on the CPU. That checks the kit itself (the tests'
plumbing, the script, the results files) on a machine without a GPU; it says nothing about CUDA.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

REHEARSE_ENV = "AREAL_GPU_CHECK_REHEARSE"
OUT_ENV = "AREAL_GPU_CHECK_OUT"  # set by scripts/gpu_check.sh: the run's results folder

REHEARSING = not torch.cuda.is_available() and os.environ.get(REHEARSE_ENV) == "cpu"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Every gpu test module: pytestmark = [pytest.mark.gpu, needs_cuda, ...]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() and not REHEARSING,
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")


def results_dir(fallback: Path) -> Path:
    """The check's results folder when the script set one, else ``fallback`` (a test's tmp dir)."""
    out = Path(os.environ[OUT_ENV]) if os.environ.get(OUT_ENV) else Path(fallback)
    out.mkdir(parents=True, exist_ok=True)
    return out


def record(name: str, data: dict[str, Any], fallback: Path) -> Path:
    """Write ``data`` (plus the device it ran on) as ``<results>/<name>.json``; returns the path."""
    info = {"device": DEVICE, "rehearsal": REHEARSING, "torch": torch.__version__, "cuda": torch.version.cuda}
    if DEVICE == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    path = results_dir(fallback) / f"{name}.json"
    path.write_text(json.dumps({**info, **data}, indent=2, default=str))
    return path


def varied_model(src_dir: str, out_dir: Path, std: float = 0.2, seed: int = 0) -> str:
    """``src_dir``'s tiny model with every matrix redrawn at ``std``. The tiny model's own init (std 0.02)
    gives near-uniform logits, so its greedy output repeats one token and a comparison of greedy outputs
    or logprobs would pass for almost any bug; at 0.2 the greedy tokens vary and logits spread."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    AutoTokenizer.from_pretrained(src_dir).save_pretrained(str(out_dir))
    return str(out_dir)
