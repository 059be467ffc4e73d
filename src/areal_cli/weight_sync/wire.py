"""The wire format of a weight push, spoken by the trainer's senders and by every server that receives:
dtype names, the flattened-bucket layout (SGLang's ``load_format="flattened_bucket"``) and the refusal."""

from __future__ import annotations

import torch


class WeightUpdateRejected(ValueError):
    """The update does not match the model; nothing was applied."""


_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise WeightUpdateRejected(f"unknown dtype {name!r}; expected one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def flat_layout(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[tuple[torch.dtype, int, int]], int]:
    """SGLang's ``load_format="flattened_bucket"`` wire layout: one uint8 buffer with the tensors'
    bytes concatenated in request order; ``[(dtype, byte offset, numel)]`` and the total bytes.
    Like SGLang's receiver, refuses a tensor whose offset is not a multiple of its dtype's size."""
    slots, off = [], 0
    for dt, shp in zip(dtypes, shapes):
        d = parse_dtype(dt)
        n = 1
        for x in shp:
            n *= int(x)
        if off % d.itemsize:
            raise WeightUpdateRejected(f"flattened_bucket: a {dt} tensor at byte offset {off} is not aligned to "
                                       f"{d.itemsize} bytes")
        slots.append((d, off, n))
        off += n * d.itemsize
    return slots, off
