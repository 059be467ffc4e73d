"""The inference-engine contract (client side), shared by the sglang, vllm and built-in hf backends.

All network-facing methods are coroutines: the rollout executor drives them from its background
event loop, and the trainer reaches them with ``asyncio.run_coroutine_threadsafe`` or
``asyncio.run``. The weight-update half of the contract is
:class:`~areal_cli.api.weight_receiver.WeightReceiver`; this class adds generation and the control of
the server set. Every public method of the HTTP client (``inference/client.py``) is declared here or
there (``tests/unit/api/test_receiver_contract.py``).
"""

from __future__ import annotations

import abc

from areal_cli.api.io_struct import ModelRequest, ModelResponse
from areal_cli.api.weight_receiver import WeightReceiver


class InferenceEngine(WeightReceiver):
    """A client for one or more inference servers."""

    # -------------------------------------------------------------- generation
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

    @property
    def supports_batch_generate(self) -> bool:
        """Whether the servers take several prompts in one call (then :meth:`agenerate_group` sends one)."""
        return False

    def end_session(self, key: str) -> None:
        """Forget a session id's server (its episode is over); no-op without session affinity."""

    def session_server(self, key: str) -> str | None:
        """The server a session id is routed to (None: not routed, or no session affinity)."""
        return None

    # -------------------------------------------------------------- the server set
    def set_addresses(self, addresses: list[str]) -> None:
        """Replace the server set (e.g. after the launcher restarted one); new ones start healthy."""
        from areal_cli.errors import LaunchError

        raise LaunchError("the inference client cannot change its server list (no set_addresses); "
                          "a restarted server cannot be used")

    def healthy_addresses(self) -> list[str]:
        """The servers currently in the routing set."""
        raise NotImplementedError(f"{type(self).__name__} does not track server health")

    async def check_health(self) -> dict[str, bool]:
        """Probe every server; healthy ones (re)join routing. Returns address -> healthy."""
        raise NotImplementedError(f"{type(self).__name__} does not track server health")

    async def get_server_versions(self) -> dict[str, int | None]:
        """Every server's own weight version."""
        raise NotImplementedError(f"{type(self).__name__} cannot read its servers' versions")

    async def check_server_versions(self) -> dict[str, str]:
        """Refuse servers whose software version is outside the supported range (default: none checked)."""
        return {}

    @property
    def weight_group_world_size(self) -> int:
        """World size of the weight-update group: the trainer plus every rank of every server."""
        return 1 + len(self.addresses)

    async def release_memory_occupation(self) -> None:
        """Free the servers' accelerator memory for a colocated trainer."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its servers' memory")

    async def resume_memory_occupation(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot release its servers' memory")

    async def close(self) -> None:
        """Release this event loop's connections (default: none held)."""
