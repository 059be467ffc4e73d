"""The ``pause_generation`` / ``continue_generation`` extension of ``/update_weights_from_distributed``:
only the hf backend advertises and sends it; SGLang/vLLM clients refuse it (their real APIs need the
explicit pause/continue calls), and the sender's group key ignores the rendezvous port only when
asked to reuse groups."""

from __future__ import annotations

import asyncio

import pytest

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.backends import hf, sglang
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.weight_sync.senders import DistributedSender

META = WeightUpdateMeta(type="distributed", version=3, group_name="g")
SPECS = [ParamSpec("a", "bfloat16", [2, 3])]


def test_hf_payload_has_the_fields_only_when_asked():
    plain = hf.build_update_distributed(META, SPECS).json
    assert "pause_generation" not in plain and "continue_generation" not in plain
    assert plain == sglang.build_update_distributed(META, SPECS).json
    body = hf.build_update_distributed(META, SPECS, flattened_bucket=True, pause_generation=True,
                                       continue_generation=True).json
    assert body == {**plain, "load_format": "flattened_bucket", "pause_generation": True, "continue_generation": True}
    assert "continue_generation" not in hf.build_update_distributed(META, SPECS, pause_generation=True).json


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_other_backends_never_advertise_or_send_it(backend):
    eng = RemoteInferenceEngine(["127.0.0.1:1"], backend)
    assert not eng.supports_atomic_update
    with pytest.raises(InferenceError, match="explicit pause/continue"):
        asyncio.run(eng.update_weights_from_distributed(META, SPECS, pause_generation=True))


def test_hf_capability_can_be_switched_off():
    assert RemoteInferenceEngine(["127.0.0.1:1"], "hf").supports_atomic_update
    assert not RemoteInferenceEngine(["127.0.0.1:1"], "hf", atomic_update=False).supports_atomic_update


def test_group_key_ignores_the_port_only_when_reusing():
    a = WeightUpdateMeta(type="distributed", master_port=1111, world_size=2)
    b = WeightUpdateMeta(type="distributed", master_port=2222, world_size=2)
    c = WeightUpdateMeta(type="distributed", master_port=2222, world_size=3)
    one, two = [RemoteInferenceEngine(["127.0.0.1:1"], "hf")], [RemoteInferenceEngine(["127.0.0.1:2"], "hf")]
    reuse, fresh = DistributedSender(runner=None), DistributedSender(runner=None, reuse_group=False)
    assert reuse._key(a, one) == reuse._key(b, one)
    assert reuse._key(a, one) != reuse._key(a, two)  # another server set needs another group
    assert reuse._key(b, one) != reuse._key(c, one)
    assert fresh._key(a, one) != fresh._key(b, one)
