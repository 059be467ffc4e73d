"""Weight updates on a real hf server (disk and gloo broadcast), api-key enforcement, and a partial
rollout that spans a weight update. The test process plays trainer rank 0 itself."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest
import torch
from hf_server_helpers import hf_greedy, prompts, start_hf_server, teacher_forced_logprobs

from areal_cli.api.io_struct import GenerationConfig, ModelRequest, ParamSpec, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.inference.server.weights import broadcast_from_root
from areal_cli.utils.network import find_free_port
from areal_cli.weight_sync.group import make_group

KEY = "test-secret-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory, api_key=KEY)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _engine(server) -> RemoteInferenceEngine:
    return RemoteInferenceEngine([server.address], "hf", timeout_s=120, api_key=KEY, backoff_s=0.05)


def _greedy(engine, p, n=16):
    return asyncio.run(engine.agenerate(ModelRequest(input_ids=p, gconfig=GenerationConfig(
        greedy=True, max_new_tokens=n)))).output_tokens


def _version(server) -> str:
    r = httpx.get(f"http://{server.address}/get_weight_version", headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["weight_version"]


def test_api_key_is_enforced(server):
    base = f"http://{server.address}"
    assert httpx.get(f"{base}/health").status_code == 200  # liveness stays open
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk",
                 "/init_weights_update_group", "/update_weights_from_distributed"):
        r = httpx.post(f"{base}{path}", json={})
        assert r.status_code == 401 and "api-key" in r.json()["error"]["message"]
        r = httpx.post(f"{base}{path}", json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    r = httpx.post(f"{base}/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


def test_disk_update_switches_weights_and_version(server, models, tok, tiny_model_dir, tiny_model_dir_b):
    engine = _engine(server)
    p = prompts(tok, 1, seed=11)[0]
    assert _greedy(engine, p) == hf_greedy(models[0], p, 16)
    asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=7, path=tiny_model_dir_b)))
    assert _version(server) == "7" and engine.get_version() == 7
    assert _greedy(engine, p) == hf_greedy(models[1], p, 16)
    asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=8, path=tiny_model_dir)))
    assert _greedy(engine, p) == hf_greedy(models[0], p, 16)
    assert _version(server) == "8"


def test_disk_update_rejects_bad_shapes_and_paths_without_half_applying(server, models, tok, tiny_model_dir_b,
                                                                        tmp_path):
    from safetensors.torch import save_file

    engine = _engine(server)
    p = prompts(tok, 1, seed=12)[0]
    before = _greedy(engine, p)
    version = _version(server)
    sd = {k: v.detach().clone().contiguous() for k, v in models[1].state_dict().items()
          if k != "lm_head.weight"}
    name = "model.layers.1.mlp.down_proj.weight"
    sd[name] = torch.zeros(sd[name].shape[0], sd[name].shape[1] + 1)  # the last-applied tensor is the bad one
    bad = tmp_path / "bad_ckpt"
    bad.mkdir()
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(InferenceError, match="shape mismatch"):
        asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=99, path=str(bad))))
    with pytest.raises(InferenceError, match="outside the allowed weight roots"):
        asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=99, path="/etc")))
    r = httpx.post(f"http://{server.address}/update_weights_from_disk", content=b"{oops",
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    assert _greedy(engine, p) == before and _version(server) == version


def _trainer_group(port: int, world: int, group: str):
    """Rank 0 as the trainer builds it (the steps of SGLang's init_custom_process_group)."""
    return None, make_group("gloo", "127.0.0.1", port, world, 0, group, 60.0)


async def _in_session(engine, *coros):
    """SGLang's weight-update session around the update(s): begin, the work, end (even on failure)."""
    await engine.begin_weight_update()
    try:
        return await asyncio.gather(*coros)
    finally:
        await engine.end_weight_update()


def _join_group(engine, meta):
    """The server joins the weight-update group while this process (the trainer, rank 0) creates it."""
    async def init():
        return await asyncio.gather(engine.init_weights_update_group(meta),
                                    asyncio.to_thread(_trainer_group, meta.master_port, meta.world_size,
                                                      meta.group_name))

    return asyncio.run(init())[1]


def test_distributed_update_over_gloo(server, models, tok):
    engine = _engine(server)
    p = prompts(tok, 1, seed=13)[0]
    port = find_free_port()
    meta = WeightUpdateMeta(type="distributed", version=21, master_address="127.0.0.1", master_port=port,
                            group_name="areal_test_group", backend="gloo", world_size=2)

    store, pg = _join_group(engine, meta)
    new = {k: v.detach() for k, v in models[1].state_dict().items()}
    specs = [ParamSpec(k, "float32", list(v.shape)) for k, v in new.items()]

    def broadcast(tensors):
        for t in tensors:
            broadcast_from_root(pg, t.contiguous().clone())

    async def push(m, sp, tensors):
        await _in_session(engine, engine.update_weights_from_distributed(m, sp), asyncio.to_thread(broadcast, tensors))

    asyncio.run(push(meta, specs, [new[s.name] for s in specs]))
    assert _version(server) == "21"
    assert _greedy(engine, p) == hf_greedy(models[1], p, 16)

    # A bucket with a wrong shape is drained (the collective stays in step) and rejected whole.
    bad_specs = [ParamSpec("model.norm.weight", "float32", [3]),
                 ParamSpec("model.embed_tokens.weight", "float32", list(new["model.embed_tokens.weight"].shape))]
    bad_tensors = [torch.zeros(3), torch.zeros_like(new["model.embed_tokens.weight"])]
    with pytest.raises(InferenceError, match="shape mismatch"):
        asyncio.run(push(meta.__class__(**{**meta.__dict__, "version": 22}), bad_specs, bad_tensors))
    assert _version(server) == "21" and _greedy(engine, p) == hf_greedy(models[1], p, 16)

    # Back to the original weights, bucketed in two broadcasts' worth of requests.
    old = {k: v.detach() for k, v in models[0].state_dict().items()}
    names = list(old)
    for i, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        m = meta.__class__(**{**meta.__dict__, "version": 23 + i})
        asyncio.run(push(m, [ParamSpec(n, "float32", list(old[n].shape)) for n in chunk], [old[n] for n in chunk]))
    assert _version(server) == "24" and _greedy(engine, p) == hf_greedy(models[0], p, 16)
    del pg, store


def test_flattened_bucket_extension(server, models, tok):
    """SGLang's load_format="flattened_bucket": the bucket's bytes in one uint8 broadcast (here bf16 on the
    wire into the fp32 model)."""
    import copy

    engine = _engine(server)
    p = prompts(tok, 1, seed=15)[0]
    port = find_free_port()
    meta = WeightUpdateMeta(type="distributed", version=40, master_address="127.0.0.1", master_port=port,
                            group_name="areal_flat_group", backend="gloo", world_size=2)

    store, pg = _join_group(engine, meta)
    new = {k: v.detach().to(torch.bfloat16) for k, v in models[1].state_dict().items()}

    async def push(m, sp, tensors):
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        await _in_session(engine, engine.update_weights_from_distributed(m, sp, flattened_bucket=True),
                          asyncio.to_thread(broadcast_from_root, pg, flat))

    # A flat bucket with a wrong shape is drained as one broadcast and rejected whole.
    bad = [ParamSpec("model.norm.weight", "bfloat16", [3]),
           ParamSpec("model.embed_tokens.weight", "bfloat16", list(new["model.embed_tokens.weight"].shape))]
    before = _greedy(engine, p)
    with pytest.raises(InferenceError, match="shape mismatch"):
        asyncio.run(push(meta, bad, [torch.zeros(3, dtype=torch.bfloat16), new["model.embed_tokens.weight"]]))
    assert _greedy(engine, p) == before

    names = list(new)
    for i, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        m = meta.__class__(**{**meta.__dict__, "version": 41 + i})
        asyncio.run(push(m, [ParamSpec(n, "bfloat16", list(new[n].shape)) for n in chunk], [new[n] for n in chunk]))
    ref = copy.deepcopy(models[1])
    with torch.no_grad():
        for t in ref.parameters():
            t.copy_(t.to(torch.bfloat16))
    assert _version(server) == "42" and _greedy(engine, p) == hf_greedy(ref, p, 16)
    del pg, store


def test_partial_rollout_spans_a_weight_update(server, models, tok, tiny_model_dir, tiny_model_dir_b):
    """A long generation is paused mid-way, the weights change, and the client resumes it. The update
    starts once ~60 tokens are out; the generation runs 10x longer, so a loaded machine still pauses it
    mid-way (a shorter one sometimes finished first on a loaded machine)."""
    n = 600
    engine = _engine(server)
    asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=30, path=tiny_model_dir)))
    p = prompts(tok, 1, seed=14)[0]
    temp = 0.9
    base = f"http://{server.address}"
    hdr = {"Authorization": f"Bearer {KEY}"}
    steps0 = httpx.get(f"{base}/get_load", headers=hdr).json()["stats"]["generated_tokens"]

    def updater():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the generation is ~60 tokens in
            if httpx.get(f"{base}/get_load", headers=hdr).json()["stats"]["generated_tokens"] - steps0 >= 60:
                break
            time.sleep(0.005)

        async def swap():
            await engine.pause_generation()
            await engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=31, path=tiny_model_dir_b))
            await engine.continue_generation()

        asyncio.run(swap())

    t = threading.Thread(target=updater)
    t.start()
    resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=p, gconfig=GenerationConfig(
        temperature=temp, max_new_tokens=n, min_new_tokens=n))))
    t.join()
    assert resp.stop_reason == "length" and resp.n_resumes >= 1
    assert len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions) == n
    k = resp.output_versions.index(31)
    assert 0 < k < n
    assert resp.output_versions == [30] * k + [31] * (n - k)
    lp_a = teacher_forced_logprobs(models[0], p, resp.output_tokens, temperature=temp)
    lp_b = teacher_forced_logprobs(models[1], p, resp.output_tokens, temperature=temp)
    want = lp_a[:k] + lp_b[k:]
    assert max(abs(a - b) for a, b in zip(resp.output_logprobs, want)) < 1e-4
    # Under the old weights the resumed tokens would have had different logprobs: the swap is real.
    assert max(abs(a - b) for a, b in zip(resp.output_logprobs[k:], lp_a[k:])) > 1e-2
    asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=32, path=tiny_model_dir)))
    assert os.path.isdir(tiny_model_dir)
