"""A peer that accepts requests but never joins / never answers makes a sync fail within its
timeout, with a WeightSyncError that names the peer (no hang). Real TCPStore + gloo group."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch  # imported up front so the timings below measure the sync, not torch's import
from hf_server_helpers import UnroutableServer

from areal_cli.api.inference_api import InferenceEngine
from areal_cli.api.io_struct import WeightUpdateMeta
from areal_cli.errors import WeightSyncError
from areal_cli.utils.concurrency import LoopRunner
from areal_cli.utils.network import find_free_port
from areal_cli.weight_sync.senders import DiskSender, DistributedSender


class HungServer(UnroutableServer, InferenceEngine):
    """Answers pause/continue, then never completes the method named ``hang_on``."""

    def __init__(self, hang_on: str):
        self.hang_on = hang_on
        self.calls: list[str] = []

    async def _maybe_hang(self, name: str) -> None:
        self.calls.append(name)
        if name == self.hang_on:
            await asyncio.sleep(3600)

    async def agenerate(self, req):
        raise NotImplementedError("not used by the sender")

    async def pause_generation(self):
        await self._maybe_hang("pause_generation")

    async def continue_generation(self):
        await self._maybe_hang("continue_generation")

    async def update_weights_from_disk(self, meta):
        await self._maybe_hang("update_weights_from_disk")

    async def init_weights_update_group(self, meta):
        await self._maybe_hang("init_weights_update_group")

    async def update_weights_from_distributed(self, meta, specs):
        await self._maybe_hang("update_weights_from_distributed")


def _tensors():
    yield "w", torch.ones(4)


def test_distributed_peer_never_joins():
    runner = LoopRunner()
    peer = HungServer("init_weights_update_group")
    meta = WeightUpdateMeta(type="distributed", master_port=find_free_port(), world_size=2, timeout_s=3.0)
    t0 = time.monotonic()
    err = DistributedSender(runner).send(meta, [peer], _tensors(), is_src=True)
    elapsed = time.monotonic() - t0
    runner.close()
    assert isinstance(err, WeightSyncError)
    assert "10.9.8.7:4321" in str(err) and "did not join" in str(err)
    assert elapsed < 3.0 + 8.0
    assert peer.calls[-1] == "continue_generation", "generation must be resumed after a failed sync"


@pytest.mark.parametrize("hang_on", ["pause_generation", "update_weights_from_disk"])
def test_disk_peer_hangs(tmp_path, hang_on):
    runner = LoopRunner()
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path), version=3, timeout_s=2.0)
    t0 = time.monotonic()
    err = DiskSender(runner).send(meta, [HungServer(hang_on)], _tensors(), is_src=True,
                                  write_dir=lambda p, t: __import__("os").makedirs(p, exist_ok=True))
    runner.close()
    assert isinstance(err, WeightSyncError)
    assert "10.9.8.7:4321" in str(err) and "timed out" in str(err)
    assert time.monotonic() - t0 < 2.0 * 2 + 3
    assert (tmp_path / "v3").is_dir()
