"""A peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), as the engines export
it, the disk push writes it and the servers load it: the file names, peft's tensor keys and the writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADAPTER_NAME = "default"  # the adapter's name inside the engine's modules (peft's default)
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SUBDIR = "lora_adapter"  # an HF export under LoRA: the merged model, and the adapter in this subdir


def peft_key(name: str) -> str:
    """Engine parameter name → the key peft's ``save_pretrained`` writes (adapter name dropped)."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def write_adapter_dir(path: str | Path, tensors: dict[str, torch.Tensor], pc: Any) -> Path:
    """peft's adapter layout (``adapter_config.json`` + ``adapter_model.safetensors``); ``tensors`` are
    keyed by engine parameter names. Written to a temp name and renamed, so a reader never sees half."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    pc.save_pretrained(str(out))
    tmp = out / (ADAPTER_FILE + ".tmp")
    save_file({peft_key(k): v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_FILE)
    return out


def config_dict(pc: Any) -> dict[str, Any]:
    """peft config as the JSON ``adapter_config.json`` holds (sets → sorted lists, enums → strings)."""
    return json.loads(json.dumps(pc.to_dict(), default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                                 else str(o)))
