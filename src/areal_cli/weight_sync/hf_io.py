"""Write HF-layout model dirs (safetensors + config + generation config + tokenizer files).

Used by the HF export of the engines and by disk weight sync. The result loads with
``AutoModelForCausalLM.from_pretrained``, the built-in ``hf`` server and vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")

# safetensors files above this size are split into shards with an index (HF convention).
MAX_SHARD_BYTES = 5 * 1024**3


def copy_tokenizer(src: str | os.PathLike | None, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files that exist in ``src`` to ``dst``; returns the names copied."""
    if not src:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copy2(p, Path(dst) / name)
            copied.append(name)
    return copied


def write_hf_dir(path: str | os.PathLike, tensors: dict[str, Any], config: Any, *,
                 architectures: list[str] | None = None, tokenizer_src: str | os.PathLike | None = None,
                 generation_config: Any = None, dtype: Any = None) -> str:
    """Write ``tensors`` (full, CPU) as ``model.safetensors`` next to ``config.json``.

    ``config`` is a transformers ``PretrainedConfig``; its ``architectures`` are set explicitly
    because FSDP2 renames the wrapped class (``FSDPQwen2ForCausalLM``). Tied ``lm_head.weight`` is
    dropped as transformers does. Writes to a temp name and renames so a reader never sees a half
    file.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if getattr(config, "tie_word_embeddings", False):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"format": "pt"}
    if total <= MAX_SHARD_BYTES:
        tmp = out / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out / "model.safetensors")
    else:
        _write_sharded(out, tensors, meta, total)
    cfg = config.__class__.from_dict(config.to_dict())
    if architectures:
        cfg.architectures = list(architectures)
    if dtype is not None:
        cfg.dtype = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else dtype
    cfg.save_pretrained(str(out))
    if generation_config is not None:
        generation_config.save_pretrained(str(out))
    copy_tokenizer(tokenizer_src, out)
    return str(out)


def _write_sharded(out: Path, tensors: dict, meta: dict, total: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata=meta)
        weight_map.update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
