"""The ``flattened_bucket`` extension of ``/update_weights_from_distributed``: only the hf backend
sends it, and the trainer's flat staging layout is exactly the layout the hf server receives into."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.backends import hf, sglang
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.inference.server.weights import bucket_layout
from areal_cli.weight_sync.senders import DistributedSender, _Bucket

META = WeightUpdateMeta(type="distributed", version=3, group_name="g")
SPECS = [ParamSpec("a", "bfloat16", [2, 3]), ParamSpec("b", "float32", [4])]


def test_sglang_payload_never_has_the_extension():
    body = sglang.build_update_distributed(META, SPECS).json
    assert "flattened_bucket" not in body
    assert body == {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
                    "group_name": "g", "flush_cache": True, "weight_version": "3"}


def test_hf_payload_has_it_only_when_asked():
    assert hf.build_update_distributed(META, SPECS).json == sglang.build_update_distributed(META, SPECS).json
    assert hf.build_update_distributed(META, SPECS, flattened_bucket=True).json["flattened_bucket"] is True


def test_client_capability_and_refusal():
    assert RemoteInferenceEngine(["127.0.0.1:1"], "hf").supports_flattened_bucket
    eng = RemoteInferenceEngine(["127.0.0.1:1"], "sglang")
    assert not eng.supports_flattened_bucket
    with pytest.raises(InferenceError, match="hf-server extension"):
        asyncio.run(eng.update_weights_from_distributed(META, SPECS, flattened_bucket=True))


def test_sender_flat_bucket_matches_server_layout():
    sender = DistributedSender(runner=None)  # staging only; nothing is sent
    g = torch.Generator().manual_seed(0)
    tensors = {"w1": torch.randn(3, 5, generator=g), "ids": torch.arange(7), "w2": torch.randn(4, generator=g),
               "w3": torch.randn(2, 2, generator=g)}
    b = _Bucket(sender, 1, flat=True)
    for n, t in tensors.items():
        b.add(n, t, torch.bfloat16 if t.is_floating_point() else t.dtype, bucket_bytes=64)
    wire = b.wire()
    assert [w.dtype for w in wire] == [torch.bfloat16, torch.int64]  # one broadcast per dtype, first-use order
    slots, totals = bucket_layout([str(t.dtype).removeprefix("torch.") for t in b.tensors],
                                  [list(t.shape) for t in b.tensors])
    assert list(totals) == [w.dtype for w in wire] and [totals[w.dtype] for w in wire] == [w.numel() for w in wire]
    flats = dict(zip(totals, wire))
    for (name, src), (d, off, k) in zip(tensors.items(), slots):
        got = flats[d][off:off + k].view(src.shape)
        want = src.to(torch.bfloat16) if src.is_floating_point() else src
        assert torch.equal(got, want), name


def test_sender_per_tensor_bucket_is_zero_copy_when_dtype_matches():
    sender = DistributedSender(runner=None)
    t = torch.randn(4, 4)
    b = _Bucket(sender, 0, flat=False)
    b.add("x", t, torch.float32, bucket_bytes=1024)
    b.add("y", t, torch.bfloat16, bucket_bytes=1024)
    assert b.tensors[0].data_ptr() == t.data_ptr()
    assert b.tensors[1].dtype == torch.bfloat16 and torch.equal(b.tensors[1], t.to(torch.bfloat16))
    assert len(b.wire()) == 2
