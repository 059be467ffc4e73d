"""What ``engine.dtype`` means, once for every engine.

``engine.dtype`` is the *compute* dtype. A model that is trained keeps fp32 master weights, fp32 gradients
(reduced in fp32) and fp32 optimizer state whatever the compute dtype: under ``bfloat16`` the matmuls run
in bf16 on a bf16 copy of the weights, and AdamW updates the fp32 masters. A bf16 update of a bf16
weight rounds away whenever it is smaller than half the weight's spacing (2^-9 of its magnitude), which
is most updates at RL learning rates: a run without masters looks healthy and barely learns.

How each backend does it (one meaning, four mechanisms):

- fsdp, archon: fp32 parameters; FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
  over several ranks, ``torch.autocast`` on one rank (nothing to shard, the module stays plain).
- deepspeed: its ``bf16`` mode (bf16 module, fp32 master partitions), the masters put back from the
  checkpoint at full precision after ``deepspeed.initialize``.
- megatron: mcore's bf16 mode (bf16 module, fp32 ``main_params`` in the optimizer), the masters put back
  from the checkpoint likewise.

An engine that is not trained (a reference model, ``forward`` only) holds its weights in the compute
dtype: there is nothing to update, and bf16 halves its memory.

The LM head's logits and the log-softmax run in fp32 on every engine (:func:`fp32_head`): near
``|logit| = 20`` bf16's spacing is 0.125, so bf16 logits move a token's logprob by up to ~0.06 nats,
straight into the PPO ratio.

``float16`` is refused: its 5-bit exponent needs a loss scaler, which no engine here runs; bf16 has the
same memory and fp32's range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_cli.errors import ConfigError

PATH = "engine.dtype"
NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
REFUSED = {"float16": "float16", "fp16": "float16", "half": "float16"}
FP16_REASON = ("float16 needs loss scaling (its range ends at 65504; small gradients underflow), and no "
               "engine here runs a loss scaler")
FP16_FIX = "use engine.dtype=bfloat16: the same memory and speed, fp32's range, no scaler needed"


def dtype_name(name: str, path: str = PATH) -> str:
    """The canonical name of a compute dtype (``float32`` or ``bfloat16``), or a ConfigError."""
    key = str(name).lower()
    if key in REFUSED:
        raise ConfigError(path, FP16_REASON, FP16_FIX)
    if key not in NAMES:
        raise ConfigError(path, f"unknown dtype {name!r}", "use float32 or bfloat16")
    return NAMES[key]


@dataclass(frozen=True)
class Precision:
    """``compute``: the dtype matmuls run in. ``params``: the dtype the module's parameters are stored
    in (fp32 masters when the engine trains). ``mixed``: the two differ (cast on the fly)."""

    compute: Any
    params: Any

    @property
    def mixed(self) -> bool:
        return self.compute != self.params


def resolve(name: str, trainable: bool) -> Precision:
    import torch

    compute = getattr(torch, dtype_name(name))
    return Precision(compute=compute, params=torch.float32 if trainable else compute)


_FP32_CLASSES: dict[type, type] = {}


def fp32_head(module: Any) -> Any:
    """Make a vocabulary (or value) projection compute in fp32 whatever the weights' and the input's
    dtype: the bf16 weight is upcast exactly, and autocast is off inside. Returns ``module``.

    For ``nn.Linear`` (a module with another forward is left alone). The module's class
    is swapped for a subclass (as FSDP2's ``fully_shard`` does), so copies keep the behaviour and module
    hooks (FSDP2's all-gather, DTensor's TP input and output styles) still run around it."""
    import torch

    cls = type(module)
    if getattr(cls, "_areal_fp32_head", False) or cls.forward is not torch.nn.Linear.forward:
        return module  # already done, or a layer with its own forward (a LoRA-wrapped head) kept as it is
    if cls not in _FP32_CLASSES:
        _FP32_CLASSES[cls] = type(f"FP32{cls.__name__}", (cls,), {"forward": _fp32_forward,
                                                                 "_areal_fp32_head": True})
    module.__class__ = _FP32_CLASSES[cls]
    return module


def _fp32_forward(self, x):
    import torch
    import torch.nn.functional as F

    b = getattr(self, "bias", None)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), self.weight.float(), None if b is None else b.float())
