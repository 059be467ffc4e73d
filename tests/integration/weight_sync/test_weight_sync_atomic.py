"""Atomic distributed pushes into a real hf server: the pause and the continue ride inside the update
requests (no separate round trips), the weight-update group is reused across pushes, and the
guarantees of the explicit pause → update → continue path still hold: a generation in flight is
aborted at the switch and resumed on the new weights with correct per-token versions, a multi-bucket
push is applied while generation is held, a failure leaves the server generating, and a server that
lost the group fails the push at once (the next push rebuilds the group)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time

import httpx
import pytest
import torch
from hf_server_helpers import UnroutableServer, hf_greedy, prompts, start_hf_server, teacher_forced_logprobs

from areal_cli.api.inference_api import InferenceEngine
from areal_cli.api.io_struct import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_cli.errors import InferenceError, WeightSyncError
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.utils.concurrency import LoopRunner
from areal_cli.utils.network import find_free_port
from areal_cli.weight_sync.group import make_group
from areal_cli.weight_sync.senders import DistributedSender


class Recording(RemoteInferenceEngine):
    """The real client; remembers which admin calls it made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str] = []

    async def pause_generation(self):
        self.calls.append("pause_generation")
        await super().pause_generation()

    async def continue_generation(self):
        self.calls.append("continue_generation")
        await super().continue_generation()

    async def init_weights_update_group(self, meta):
        self.calls.append("init_weights_update_group")
        await super().init_weights_update_group(meta)

    async def update_weights_from_distributed(self, meta, specs, **kw):
        self.calls.append("update:" + ",".join(sorted(k for k, v in kw.items() if v)))
        await super().update_weights_from_distributed(meta, specs, **kw)


def _named(model, corrupt: str | None = None):
    seen = set()
    for n, t in model.state_dict().items():
        if id(t) not in seen:
            seen.add(id(t))
            yield n, (torch.zeros(3) if n == corrupt else t)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    return prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 1, seed=31)[0]


@pytest.fixture(scope="module")
def sync(server):
    runner = LoopRunner()
    sender = DistributedSender(runner)
    client = Recording([server.address], "hf", timeout_s=120, retries=1, backoff_s=0.05)
    yield sender, client, runner
    runner.run(client.close())
    sender.close()
    runner.close()


def _meta(version: int, **kw) -> WeightUpdateMeta:
    return WeightUpdateMeta(type="distributed", version=version, master_port=find_free_port(), world_size=2,
                            timeout_s=60, **kw)


def _load(server) -> dict:
    return httpx.get(f"http://{server.address}/get_load").json()


def _greedy(server, p, n=16) -> list[int]:
    eng = RemoteInferenceEngine([server.address], "hf", timeout_s=120)
    return asyncio.run(eng.agenerate(ModelRequest(input_ids=p, gconfig=GenerationConfig(
        greedy=True, max_new_tokens=n)))).output_tokens


def test_generation_in_flight_switches_at_one_boundary(server, models, prompt, sync):
    """One-bucket push while a 400-token generation runs (400, so that a loaded machine still
    pushes before it ends): one request, no pause/continue calls; the
    generation is aborted at the switch and resumed on the new weights; versions and logprobs show
    exactly one switch point."""
    sender, client, _ = sync
    assert client.supports_atomic_update
    err = sender.send(_meta(1), [client], _named(models[0]), is_src=True)  # known start: weights A, v1
    assert err is None, err
    client.calls.clear()
    temp = 0.9
    steps0 = _load(server)["stats"]["generated_tokens"]
    errors: list = []

    def pusher():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _load(server)["stats"]["generated_tokens"] - steps0 < 60:
            time.sleep(0.005)
        errors.append(sender.send(_meta(2), [client], _named(models[1]), is_src=True))

    t = threading.Thread(target=pusher)
    t.start()
    eng = RemoteInferenceEngine([server.address], "hf", timeout_s=120, backoff_s=0.05)
    resp = asyncio.run(eng.agenerate(ModelRequest(input_ids=prompt, gconfig=GenerationConfig(
        temperature=temp, max_new_tokens=400, min_new_tokens=400))))
    t.join()
    assert errors == [None]
    assert client.calls == ["update:continue_generation,flattened_bucket,pause_generation"]
    last = sender.last_seconds
    assert last["atomic"] == 1.0 and last["buckets"] == 1.0
    assert resp.stop_reason == "length" and resp.n_resumes >= 1
    k = resp.output_versions.index(2)
    assert 0 < k < 400 and resp.output_versions == [1] * k + [2] * (400 - k)
    lp_a = teacher_forced_logprobs(models[0], prompt, resp.output_tokens, temperature=temp)
    lp_b = teacher_forced_logprobs(models[1], prompt, resp.output_tokens, temperature=temp)
    assert max(abs(a - b) for a, b in zip(resp.output_logprobs, lp_a[:k] + lp_b[k:])) < 1e-4
    assert max(abs(a - b) for a, b in zip(resp.output_logprobs[k:], lp_a[k:])) > 1e-2  # the swap is real
    assert _load(server)["paused"] is False


def test_group_is_reused_and_multi_bucket_push_holds_generation(server, models, prompt, sync):
    """A later push names another port but reuses the group (no join call); many small buckets each
    ask for a pause and only the last one continues; the result equals HF greedy on the new weights."""
    sender, client, _ = sync
    assert sender.send(_meta(3), [client], _named(models[0]), is_src=True) is None
    client.calls.clear()
    assert sender.send(_meta(4, bucket_bytes=16 * 1024), [client], _named(models[1]), is_src=True) is None
    n = int(sender.last_seconds["buckets"])
    assert n > 4
    assert "init_weights_update_group" not in client.calls and "pause_generation" not in client.calls
    assert client.calls == ["update:flattened_bucket,pause_generation"] * (n - 1) + \
        ["update:continue_generation,flattened_bucket,pause_generation"]
    assert _load(server)["paused"] is False
    assert httpx.get(f"http://{server.address}/get_weight_version").json()["weight_version"] == "4"
    assert _greedy(server, prompt) == hf_greedy(models[1], prompt, 16)


def test_failed_multi_bucket_push_leaves_server_generating(server, models, prompt, sync):
    """A later bucket is rejected after earlier ones paused the server: the sender continues it."""
    sender, client, _ = sync
    names = [n for n, _ in _named(models[0])]
    client.calls.clear()
    err = sender.send(_meta(5, bucket_bytes=16 * 1024), [client], _named(models[0], corrupt=names[-1]),
                      is_src=True)
    assert isinstance(err, WeightSyncError) and "shape mismatch" in str(err)
    assert client.calls[-1] == "continue_generation"
    assert _load(server)["paused"] is False
    # the failure dropped the group: the next push joins again and works
    client.calls.clear()
    assert sender.send(_meta(6), [client], _named(models[0]), is_src=True) is None
    assert client.calls[0] == "init_weights_update_group"
    assert _greedy(server, prompt) == hf_greedy(models[0], prompt, 16)


def test_server_without_the_group_fails_fast_then_recovers(server, models, prompt, sync):
    """A server that lost its group (as after a restart): the push fails at once, naming the server,
    not at the 60 s broadcast timeout. The next push rebuilds the group."""
    sender, client, _ = sync
    assert sender.send(_meta(7), [client], _named(models[1]), is_src=True) is None
    httpx.post(f"http://{server.address}/destroy_weights_update_group", json={}).raise_for_status()
    t0 = time.monotonic()
    err = sender.send(_meta(8), [client], _named(models[0]), is_src=True)
    assert isinstance(err, WeightSyncError) and server.address in str(err)
    assert time.monotonic() - t0 < 10, "must fail fast, not at the 60 s broadcast timeout"
    assert _load(server)["paused"] is False
    assert sender.send(_meta(9), [client], _named(models[0]), is_src=True) is None
    assert httpx.get(f"http://{server.address}/get_weight_version").json()["weight_version"] == "9"
    assert _greedy(server, prompt) == hf_greedy(models[0], prompt, 16)


def test_explicit_path_when_atomic_is_off(server, models, prompt, sync):
    """``atomic_update=False`` (and SGLang/vLLM, which never advertise it) keeps pause → update → continue."""
    sender, _, runner = sync
    plain = Recording([server.address], "hf", timeout_s=120, retries=1, atomic_update=False)
    assert not plain.supports_atomic_update
    assert sender.send(_meta(10), [plain], _named(models[1]), is_src=True) is None
    runner.run(plain.close())
    assert plain.calls[0] == "pause_generation" and plain.calls[-1] == "continue_generation"
    assert all(c in ("update:flattened_bucket", "pause_generation", "continue_generation", "init_weights_update_group")
               for c in plain.calls)
    assert _greedy(server, prompt) == hf_greedy(models[1], prompt, 16)


def test_renamed_group_replaces_the_old_one(server, models, prompt, sync):
    """After a server restart the trainer renames the group (``ServerFleet.group_epoch``): a server
    that kept the old group joins the new one, the trainer releases the old one, and later pushes
    reuse the new one."""
    from torch.distributed.distributed_c10d import _world

    sender, client, _ = sync
    assert sender.send(_meta(11), [client], _named(models[0]), is_src=True) is None
    old_name = _meta(0).group_name
    assert old_name in _world.pg_names.values()
    client.calls.clear()
    renamed = f"{old_name}_r1"
    assert sender.send(_meta(12, group_name=renamed), [client], _named(models[1]), is_src=True) is None
    assert client.calls[0] == "init_weights_update_group"
    assert old_name not in _world.pg_names.values(), "the replaced group is still registered"
    assert _greedy(server, prompt) == hf_greedy(models[1], prompt, 16)
    client.calls.clear()
    assert sender.send(_meta(13, group_name=renamed), [client], _named(models[0]), is_src=True) is None
    assert "init_weights_update_group" not in client.calls
    assert httpx.get(f"http://{server.address}/get_weight_version").json()["weight_version"] == "13"
    assert _greedy(server, prompt) == hf_greedy(models[0], prompt, 16)


def _join_rank1(conn, address, port, world, group_name):
    """A server's side of the group, the way a server joins (SGLang's helper's steps); then waits."""
    make_group("gloo", address, port, world, 1, group_name, 30.0)
    conn.send("joined")
    try:
        conn.recv()  # until the test closes its end
    except EOFError:
        pass


class _RefusingPeer(UnroutableServer, InferenceEngine):
    """Joins the real gloo group (rank 1, in a thread) but refuses every update request at once, so
    the trainer's broadcast would wait for a receive that never comes."""

    supports_atomic_update = True

    def __init__(self):
        self.held: list = []

    async def agenerate(self, req):
        raise NotImplementedError("not used by the sender")

    async def init_weights_update_group(self, meta):
        def join():  # rank 1 in its own process (torch keeps one group per name and process)
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_join_rank1, args=(child, meta.master_address, meta.master_port,
                                                         meta.world_size, meta.group_name), daemon=True)
            proc.start()
            self.held.append((proc, parent))
            parent.recv()  # joined

        await asyncio.to_thread(join)

    async def update_weights_from_distributed(self, meta, specs, **kw):
        raise InferenceError("10.9.8.7:4321/update_weights_from_distributed rejected the request (400): "
                             "no weight-update group")

    async def pause_generation(self):
        pass

    async def continue_generation(self):
        pass

    async def update_weights_from_disk(self, meta):
        raise NotImplementedError


def test_refused_request_fails_the_push_without_waiting_for_the_broadcast():
    runner = LoopRunner()
    sender = DistributedSender(runner)
    meta = WeightUpdateMeta(type="distributed", version=1, master_port=find_free_port(), world_size=2,
                            timeout_s=30)
    t0 = time.monotonic()
    peer = _RefusingPeer()
    err = sender.send(meta, [peer], iter([("w", torch.ones(8 * 1024 * 1024))]), is_src=True)
    elapsed = time.monotonic() - t0
    runner.close()
    for proc, conn in peer.held:
        conn.close()
        proc.join(timeout=30)
    assert isinstance(err, WeightSyncError) and "10.9.8.7:4321" in str(err) and "no weight-update group" in str(err)
    assert elapsed < 10, f"took {elapsed:.1f}s: waited for the broadcast instead of failing on the refusal"
    assert sender.pg is None  # rebuilt by the next push
