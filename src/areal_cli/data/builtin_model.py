"""The built-in tiny models: a tokenizer trained on the built-in task plus a random tiny Qwen2 (``tiny``),
Qwen3-MoE (``tiny_moe``: 4 experts, top-2), Qwen2.5-VL (``tiny_vl``: ``tiny``'s language model with mrope,
a 2-block ViT and merger; models/tiny_vl.py) or Qwen2-VL (``tiny_qwen2_vl``: the same sizes in Qwen2-VL's
layout). Each is one option of the ``model`` group
(``conf/model/<name>.yaml``, ``path: builtin:<name>``); a size without a preset would validate against
another model's facts, so there is none.

``ensure_builtin_model(fileroot)`` creates it on first use under
``<fileroot>/models/builtin-<hash>`` and returns that dir on every later call. The hash covers the
spec and :data:`BUILD_VERSION`, so changing the architecture builds a new model next to the old one.
A file lock plus an atomic rename make concurrent first use (trainer ranks, servers, two runs)
safe: exactly one process builds, the others wait and reuse the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.model import ModelConfig

# 2: the chat template renders tools, tool calls and tool turns (plain chats render as before)
BUILD_VERSION = 2
# The vision-language build's own version (text specs keep their digests): 2 ships processing_tiny_vl.py
# and its auto_map (models/tiny_vl.py), which vLLM needs to serve the model without torchvision.
VL_BUILD_VERSION = 2
READY_MARKER = "BUILTIN_READY"


@dataclass(frozen=True)
class BuiltinModelSpec:
    """Architecture of a built-in model and the task its tokenizer is trained on."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 400  # BPE target; digits are always single tokens
    max_position_embeddings: int = 512
    task: str = "arith"
    seed: int = 0  # weight init
    family: str = "qwen2"  # qwen2 (dense) | qwen3_moe (every layer an MoE layer) | qwen2_5_vl | qwen2_vl
    num_experts: int = 0  # qwen3_moe: experts per layer
    num_experts_per_tok: int = 0  # qwen3_moe: top-k
    moe_intermediate_size: int = 0  # qwen3_moe: each expert's FFN width
    vision_depth: int = 0  # VL families: ViT blocks
    vision_hidden_size: int = 0  # VL families: ViT width
    vision_intermediate_size: int = 0  # VL families: ViT MLP width (qwen2_vl: a multiple of the width)
    vision_num_heads: int = 0  # VL families: ViT heads
    vision_patch_size: int = 0  # VL families: patch side in pixels (2x2 patches merge into one image token)

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if self.family not in VL_FAMILIES:  # the other specs hash as before the vision fields existed
            for k in VISION_FIELDS:
                fields.pop(k)
        else:
            fields["vl_build"] = VL_BUILD_VERSION
        if self.family == "qwen2":  # the dense specs hash as before the MoE fields existed (same cached dirs)
            for k in ("family", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                fields.pop(k)
        blob = json.dumps({"v": BUILD_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


VL_FAMILIES = ("qwen2_5_vl", "qwen2_vl")  # models/tiny_vl.py FAMILIES
VISION_FIELDS = ("vision_depth", "vision_hidden_size", "vision_intermediate_size", "vision_num_heads",
                 "vision_patch_size")

# The embedded default's model (docs/embedded_default.md explains the choice) and its MoE sibling.
BUILTIN_SPECS: dict[str, BuiltinModelSpec] = {
    "tiny": BuiltinModelSpec(),
    # model=tiny_moe: a Qwen3-MoE as wide as tiny, 4 experts of width 256, top-2 (active FFN width 512)
    "tiny_moe": BuiltinModelSpec(family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=256),
    # model=tiny_vl: tiny's language model under a 2-block, 64-wide ViT with 8 px patches (a 64x64 image is 16
    # image tokens); its tokenizer also knows the built-in visual task's words
    "tiny_vl": BuiltinModelSpec(family="qwen2_5_vl", task="count_shapes", vision_depth=2, vision_hidden_size=64,
                                vision_intermediate_size=128, vision_num_heads=4, vision_patch_size=8),
    # model=tiny_qwen2_vl: the same sizes as tiny_vl in Qwen2-VL's layout (LayerNorm blocks, a GELU MLP of
    # 2x the width, no windowed attention)
    "tiny_qwen2_vl": BuiltinModelSpec(family="qwen2_vl", task="count_shapes", vision_depth=2, vision_hidden_size=64,
                                      vision_intermediate_size=128, vision_num_heads=4, vision_patch_size=8),
}


def parse_builtin_model_path(path: str) -> str | None:
    """``"builtin:tiny"`` → ``"tiny"``; any other path → ``None``."""
    if isinstance(path, str) and path.startswith("builtin:"):
        return path.split(":", 1)[1] or "tiny"
    return None


def resolve_spec(spec: str | BuiltinModelSpec, overrides: dict[str, Any] | None = None) -> BuiltinModelSpec:
    if isinstance(spec, str):
        if spec not in BUILTIN_SPECS:
            raise ConfigError("model.path", f"unknown built-in model {spec!r}",
                              f"use one of: {', '.join('builtin:' + s for s in sorted(BUILTIN_SPECS))}")
        spec = BUILTIN_SPECS[spec]
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(BuiltinModelSpec)}
        if unknown:
            raise ValueError(f"unknown BuiltinModelSpec fields: {sorted(unknown)}")
        spec = dataclasses.replace(spec, **overrides)
    if spec.family == "qwen3_moe" and not 0 < spec.num_experts_per_tok <= spec.num_experts:
        raise ConfigError("model.num_experts_per_tok", f"top-k {spec.num_experts_per_tok} is not in "
                          f"1..num_experts={spec.num_experts}",
                          "set model.num_experts_per_tok between 1 and model.num_experts")
    if spec.family in VL_FAMILIES and (spec.vision_depth < 1 or spec.vision_num_heads < 1
                                       or spec.vision_patch_size < 1
                                       or spec.vision_hidden_size % spec.vision_num_heads):
        raise ConfigError("model.vision.depth", f"vision tower depth={spec.vision_depth}, heads="
                          f"{spec.vision_num_heads}, hidden_size={spec.vision_hidden_size}, patch_size="
                          f"{spec.vision_patch_size} is not a usable tower", "set model.vision.depth, num_heads and "
                          "patch_size to at least 1, with num_heads dividing model.vision.hidden_size")
    if spec.family == "qwen2_vl" and (spec.vision_hidden_size < 1
                                      or spec.vision_intermediate_size % spec.vision_hidden_size):
        raise ConfigError("model.vision.intermediate_size", f"{spec.vision_intermediate_size} is not a multiple of "
                          f"model.vision.hidden_size={spec.vision_hidden_size}, as Qwen2-VL's mlp_ratio (an "
                          "integer) needs", "set model.vision.intermediate_size to hidden_size times an integer")
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ConfigError("model.hidden_size", f"hidden_size={spec.hidden_size}, heads={spec.num_heads}, "
                          f"kv_heads={spec.num_kv_heads} do not divide", "pick heads dividing hidden_size "
                          "and kv_heads dividing heads")
    return spec


def builtin_model_dir(fileroot: str | os.PathLike, spec: str | BuiltinModelSpec = "tiny") -> Path:
    s = resolve_spec(spec)
    return Path(os.path.expanduser(str(fileroot))) / "models" / f"builtin-{s.digest()}"


def ensure_builtin_model(fileroot: str | os.PathLike, spec: str | BuiltinModelSpec = "tiny", *,
                         overrides: dict[str, Any] | None = None, timeout_s: float = 600.0) -> str:
    """Return the dir of the built-in model, building it first if needed (concurrency-safe)."""
    return ensure_builtin_model_ex(fileroot, spec, overrides=overrides, timeout_s=timeout_s)[0]


def ensure_builtin_model_ex(fileroot: str | os.PathLike, spec: str | BuiltinModelSpec = "tiny", *,
                            overrides: dict[str, Any] | None = None,
                            timeout_s: float = 600.0) -> tuple[str, bool]:
    """Like :func:`ensure_builtin_model`, plus whether this call built it (for logs and tests)."""
    import fcntl

    s = resolve_spec(spec, overrides)
    root = Path(os.path.expanduser(str(fileroot))) / "models"
    final = root / f"builtin-{s.digest()}"
    if (final / READY_MARKER).exists():
        return str(final), False
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".builtin-{s.digest()}.lock"
    with open(lock_path, "a+") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout_s:.0f}s for the lock {lock_path}; another "
                                       f"process is building the built-in model (or died holding it)")
                time.sleep(0.2)
        try:
            if (final / READY_MARKER).exists():  # built by whoever held the lock before us
                return str(final), False
            tmp = root / f".builtin-{s.digest()}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            _build(tmp, s)
            (tmp / READY_MARKER).write_text(json.dumps(dataclasses.asdict(s), indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a half-built dir from a crash before the marker
            os.replace(tmp, final)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return str(final), True


def _build(out: Path, s: BuiltinModelSpec) -> None:
    from areal_cli.data import builtin
    from areal_cli.models.tiny import make_tiny_model, train_tokenizer

    common = dict(hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=s.num_heads,
                  num_kv_heads=s.num_kv_heads, max_position_embeddings=s.max_position_embeddings)
    if s.family in VL_FAMILIES:
        from areal_cli.data import builtin_vision
        from areal_cli.models.tiny_vl import make_tiny_vl_model

        make_tiny_vl_model(out, builtin.corpus("arith") + builtin_vision.corpus(s.task), seed=s.seed,
                           vocab_size=s.vocab_size, family=s.family, intermediate_size=s.intermediate_size,
                           vision_depth=s.vision_depth, vision_hidden_size=s.vision_hidden_size,
                           vision_intermediate_size=s.vision_intermediate_size,
                           vision_num_heads=s.vision_num_heads, patch_size=s.vision_patch_size, **common)
        return
    train_tokenizer(out, builtin.corpus(s.task), vocab_size=s.vocab_size,
                    model_max_length=s.max_position_embeddings)
    if s.family == "qwen3_moe":
        make_tiny_model(out, tokenizer_dir=out, seed=s.seed, family="qwen3_moe", num_experts=s.num_experts,
                        top_k=s.num_experts_per_tok, moe_intermediate_size=s.moe_intermediate_size, **common)
    else:
        make_tiny_model(out, tokenizer_dir=out, seed=s.seed, intermediate_size=s.intermediate_size, **common)


def overrides_from_model_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """Spec fields from the ``model`` config group, so ``model.hidden_size=256`` with
    ``model.path=builtin:tiny`` builds (and caches separately) a 256-wide built-in model.

    ``vocab_size`` is not taken: the tokenizer decides the real vocabulary, and validation only
    needs an upper bound.
    """
    out = {"hidden_size": int(model_cfg.hidden_size), "num_layers": int(model_cfg.num_hidden_layers),
           "num_heads": int(model_cfg.num_attention_heads),
           "num_kv_heads": int(model_cfg.num_key_value_heads),
           "intermediate_size": int(model_cfg.intermediate_size)}
    experts = int(getattr(model_cfg, "num_experts", 0) or 0)
    if experts > 0:
        out.update(family="qwen3_moe", num_experts=experts,
                   num_experts_per_tok=int(model_cfg.num_experts_per_tok),
                   moe_intermediate_size=int(model_cfg.moe_intermediate_size))
    vision = getattr(model_cfg, "vision", None)
    if vision is not None and int(vision.depth) > 0:
        out.update(family=str(vision.family), task="count_shapes", vision_depth=int(vision.depth),
                   vision_hidden_size=int(vision.hidden_size), vision_intermediate_size=int(vision.intermediate_size),
                   vision_num_heads=int(vision.num_heads), vision_patch_size=int(vision.patch_size))
    return out
