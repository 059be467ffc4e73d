"""The inference-engine contract (client side), shared by the sglang, vllm and built-in hf backends.

All network-facing methods are coroutines: the rollout executor drives them from its background
event loop, and the trainer reaches them with ``asyncio.run_coroutine_threadsafe`` or
``asyncio.run``.
"""

from __future__ import annotations

import abc

from areal_cli.api.io_struct import ModelRequest, ModelResponse, ParamSpec, WeightUpdateMeta


class InferenceEngine(abc.ABC):
    """A client for one or more inference servers."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request. An ``abort`` caused by a weight update is resumed
        transparently (prompt + tokens so far, remaining budget), so the final response may span
        versions and only ever ends with ``stop`` or ``length``."""

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """:meth:`agenerate` for several requests (e.g. a GRPO group), results in order. Clients whose
        servers take batched requests override it to send one call for all of them."""
        import asyncio

        return list(await asyncio.gather(*(self.agenerate(r) for r in reqs)))

    @abc.abstractmethod
    async def pause_generation(self) -> None:
        """Servers abort running requests (returning partial tokens) and hold new ones."""

    @abc.abstractmethod
    async def continue_generation(self) -> None: ...

    @abc.abstractmethod
    async def update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        """Every server loads safetensors from ``meta.path`` and sets its version to ``meta.version``."""

    @abc.abstractmethod
    async def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        """Servers join the weight-update group (ranks 1..N); the trainer joins as rank 0."""

    @abc.abstractmethod
    async def update_weights_from_distributed(self, meta: WeightUpdateMeta, specs: list[ParamSpec]) -> None:
        """Servers receive one bucket of tensors by broadcast from group rank 0.
        ``meta.version`` is applied with the bucket (servers apply the final version atomically)."""

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @property
    @abc.abstractmethod
    def addresses(self) -> list[str]:
        """``host:port`` of each server this client routes to."""
