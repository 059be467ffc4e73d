"""``load_format="flattened_bucket"`` (SGLang's, also spoken by the hf server): the bucket's tensors go as
one uint8 broadcast, their bytes in request order, each at an offset aligned to its dtype. The
trainer's staging must be exactly what the hf server's ``flat_layout`` (and SGLang's
``FlattenedTensorBucket``, tests/integration/inference/test_sglang_contract.py) reads back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.backends import hf, sglang
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.weight_sync.wire import WeightUpdateRejected, flat_layout
from areal_cli.weight_sync.senders import DistributedSender, _Bucket

META = WeightUpdateMeta(type="distributed", version=3, group_name="g")
SPECS = [ParamSpec("a", "bfloat16", [2, 3]), ParamSpec("b", "float32", [4])]


def test_payload_only_when_asked():
    body = sglang.build_update_distributed(META, SPECS).json
    assert body == {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
                    "group_name": "g", "flush_cache": True, "weight_version": "3"}
    flat = sglang.build_update_distributed(META, SPECS, flattened_bucket=True).json
    assert flat == {**body, "load_format": "flattened_bucket"}
    assert hf.build_update_distributed(META, SPECS, flattened_bucket=True).json == flat


def test_client_capability_and_refusal():
    assert RemoteInferenceEngine(["127.0.0.1:1"], "hf").supports_flattened_bucket
    assert RemoteInferenceEngine(["127.0.0.1:1"], "sglang").supports_flattened_bucket
    assert not RemoteInferenceEngine(["127.0.0.1:1"], "sglang", flattened_bucket=False).supports_flattened_bucket
    eng = RemoteInferenceEngine(["127.0.0.1:1"], "vllm")
    assert not eng.supports_flattened_bucket
    with pytest.raises(InferenceError, match="one broadcast per tensor"):
        asyncio.run(eng.update_weights_from_distributed(META, SPECS, flattened_bucket=True))


def test_sender_flat_bucket_matches_server_layout():
    sender = DistributedSender(runner=None)  # staging only; nothing is sent
    g = torch.Generator().manual_seed(0)
    # 12 + 4 bf16 = 32 bytes, so the int64 tensor starts aligned; then 7 int64 and 4 bf16
    tensors = {"w1": torch.randn(3, 4, generator=g), "w2": torch.randn(4, generator=g),
               "ids": torch.arange(7), "w3": torch.randn(2, 2, generator=g)}
    b = _Bucket(sender, 1, flat=True)
    for n, t in tensors.items():
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        assert b.aligned_for(dtype), n
        b.add(n, t, dtype, bucket_bytes=64)
    (wire,) = b.wire()
    assert wire.dtype == torch.uint8 and wire.numel() == b.byte_fill
    slots, nbytes = flat_layout([str(t.dtype).removeprefix("torch.") for t in b.tensors],
                                [list(t.shape) for t in b.tensors])
    assert nbytes == wire.numel()
    for (name, src), (d, off, k) in zip(tensors.items(), slots):
        got = wire[off:off + k * d.itemsize].view(d).view(src.shape)
        want = src.to(torch.bfloat16) if src.is_floating_point() else src
        assert torch.equal(got, want), name


def test_misaligned_tensor_needs_a_new_bucket():
    sender = DistributedSender(runner=None)
    b = _Bucket(sender, 0, flat=True)
    b.add("odd", torch.ones(3), torch.bfloat16, bucket_bytes=64)  # 6 bytes
    assert not b.aligned_for(torch.int64) and b.aligned_for(torch.bfloat16)
    with pytest.raises(WeightUpdateRejected, match="not aligned"):
        flat_layout(["bfloat16", "int64"], [[3], [2]])
