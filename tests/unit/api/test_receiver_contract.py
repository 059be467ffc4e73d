"""The HTTP inference client offers nothing the contract in ``api/`` does not declare, so the senders
and the trainer can call every method directly instead of probing the client for it."""

from __future__ import annotations

import inspect

from areal_cli.api.inference_api import InferenceEngine
from areal_cli.api.weight_receiver import WeightReceiver
from areal_cli.inference.client import RemoteInferenceEngine

# Class-level helpers of the client that are not server calls.
NOT_CALLS = {"AFFINITY_KEYS", "run_sync"}


def _public(cls: type) -> set[str]:
    return {n for klass in cls.__mro__ if klass is not object for n in vars(klass) if not n.startswith("_")}


def test_every_public_member_of_the_client_is_declared_in_the_api():
    undeclared = {n for n in vars(RemoteInferenceEngine) if not n.startswith("_")} - _public(InferenceEngine) \
        - NOT_CALLS
    assert not undeclared, f"declare these in api/inference_api.py or api/weight_receiver.py: {sorted(undeclared)}"


def test_every_weight_call_of_the_senders_is_a_receiver_member():
    # what weight_sync/ calls on a client: each one declared by WeightReceiver with the client's signature
    for name in ("pause_generation", "continue_generation", "begin_weight_update", "end_weight_update",
                 "update_weights_from_disk", "init_weights_update_group", "update_weights_from_distributed",
                 "load_lora_adapter", "load_lora_adapter_from_distributed"):
        declared = inspect.signature(getattr(WeightReceiver, name))
        offered = inspect.signature(getattr(RemoteInferenceEngine, name))
        assert list(declared.parameters) == list(offered.parameters), name
    for prop in ("supports_flattened_bucket", "supports_atomic_update", "supports_lora_broadcast",
                 "broadcast_refusal", "addresses"):
        assert isinstance(inspect.getattr_static(WeightReceiver, prop), property), prop
