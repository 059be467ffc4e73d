"""The receiving side of weight sync: every call a trainer-side sender makes on an inference client.

The senders (``weight_sync/``) call these methods directly; they never probe a client for what it
offers. What a backend may lack has a declared default here (no session to open, no flattened or
atomic buckets, no adapter broadcast), so a client implements only what its servers do differently.
:class:`~areal_cli.api.inference_api.InferenceEngine` extends this contract with generation and the
server-set control the trainer uses.
"""

from __future__ import annotations

import abc

from areal_cli.api.io_struct import ParamSpec, WeightUpdateMeta


class WeightReceiver(abc.ABC):
    """One or more inference servers that take weight updates (full weights or a LoRA adapter)."""

    # -------------------------------------------------------------- identity and version
    @property
    @abc.abstractmethod
    def addresses(self) -> list[str]:
        """``host:port`` of each server this client routes to."""

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    # -------------------------------------------------------------- generation around a push
    @abc.abstractmethod
    async def pause_generation(self) -> None:
        """Servers abort running requests (returning partial tokens) and hold new ones."""

    @abc.abstractmethod
    async def continue_generation(self) -> None: ...

    async def begin_weight_update(self) -> None:
        """Open the weight-update session SGLang requires around an update (default: none needed)."""

    async def end_weight_update(self) -> None:
        """Close the session :meth:`begin_weight_update` opened (always, once begun)."""

    # -------------------------------------------------------------- full weights
    @abc.abstractmethod
    async def update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        """Every server loads safetensors from ``meta.path`` and sets its version to ``meta.version``."""

    @abc.abstractmethod
    async def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        """Servers join the weight-update group (ranks 1..N); the trainer joins as rank 0."""

    @abc.abstractmethod
    async def update_weights_from_distributed(self, meta: WeightUpdateMeta, specs: list[ParamSpec], *,
                                              flattened_bucket: bool = False, pause_generation: bool = False,
                                              continue_generation: bool = False) -> None:
        """Servers receive one bucket of tensors by broadcast from group rank 0.
        ``meta.version`` is applied with the bucket (servers apply the final version atomically).
        ``flattened_bucket``: one uint8 broadcast of the bucket (only when
        :attr:`supports_flattened_bucket`); ``pause_generation`` / ``continue_generation``: the server
        pauses right before applying the bucket and/or continues right after (only when
        :attr:`supports_atomic_update`)."""

    @property
    def supports_flattened_bucket(self) -> bool:
        """Whether the servers take a bucket as one flattened uint8 broadcast."""
        return False

    @property
    def supports_atomic_update(self) -> bool:
        """Whether the servers pause and continue generation themselves inside an update request, so
        the sender sends no separate pause/continue calls."""
        return False

    @property
    def broadcast_refusal(self) -> str | None:
        """Why these servers cannot receive a broadcast at all (None: they can)."""
        return None

    # -------------------------------------------------------------- LoRA adapters
    async def load_lora_adapter(self, name: str, path: str, version: int) -> None:
        """Load adapter version ``version`` from the peft dir ``path`` under ``name`` on every server."""
        raise NotImplementedError(f"{type(self).__name__} cannot load LoRA adapters")

    @property
    def supports_lora_broadcast(self) -> bool:
        """Whether the servers take an adapter over the weight-update group."""
        return False

    async def load_lora_adapter_from_distributed(self, meta: WeightUpdateMeta, name: str, config: dict,
                                                 specs: list[ParamSpec]) -> None:
        """Servers receive the adapter (one flattened broadcast) and serve it under ``name``."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive an adapter by broadcast")
