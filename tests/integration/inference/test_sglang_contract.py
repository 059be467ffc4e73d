"""The client and the weight push against SGLang's own code (sglang 0.5.23; issue 25).

Each simulated server is ``sglang_harness.py``: SGLang's real HTTP app and request models, and TP
rank processes holding SGLang's own ``WeightUpdater`` (its ``init_custom_process_group`` and its
receive path). What is SGLang's own here: route → request model binding and validation, the
``/generate`` contract gate (unknown sampling keys), ``GenerateReqInput`` normalisation,
``SamplingParams``, ``/model_info``'s shape, the group rendezvous and the receive of per-tensor and
``flattened_bucket`` updates. Not SGLang's: the stand-in behind the routes (no scheduler, no model).

Every request body the project's client sent is checked against the request model of the route
that received it: SGLang ignores unknown keys, so a field the client names differently from SGLang
would otherwise pass silently; here it fails the test.

Needs ``bash scripts/setup_sglang_contract.sh`` (run by scripts/install_test_deps.sh); without it
the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import sglang_harness
import torch
from support_paths import SUPPORT

from areal_cli.api.io_struct import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.backends import sglang as sgl
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.utils.concurrency import LoopRunner
from areal_cli.utils.network import find_free_port
from areal_cli.utils.procs import die_with_parent
from areal_cli.weight_sync.senders import DistributedSender

TP = 2
N_SERVERS = 2


def _require_sglang() -> None:
    if sglang_harness.available():
        return
    msg = f"sglang {sglang_harness.SGLANG_VERSION} not installed in {sglang_harness.sglang_path()}: " \
          "run bash scripts/setup_sglang_contract.sh"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    _require_sglang()
    logs = tmp_path_factory.mktemp("sglang_harness")
    procs, addrs = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SUPPORT)}
    try:
        for i in range(N_SERVERS):
            port, tp_port = find_free_port(), find_free_port()
            log = open(logs / f"server{i}.log", "w")
            procs.append((subprocess.Popen(
                [sys.executable, str(Path(sglang_harness.__file__)), "--port", str(port), "--tp", str(TP),
                 "--tp-port", str(tp_port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL)), logs / f"server{i}.log"))
            addrs.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 240
        for (p, log), a in zip(procs, addrs):
            while True:
                if p.poll() is not None:
                    pytest.fail(f"sglang harness {a} exited: {Path(log).read_text()[-3000:]}")
                try:
                    if httpx.get(f"http://{a}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"sglang harness {a} not ready: {Path(log).read_text()[-3000:]}")
                time.sleep(0.5)
        yield addrs
    finally:
        for p, _ in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the harness and its TP rank processes
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def _contract(addr: str) -> dict:
    return httpx.get(f"http://{addr}/_contract", timeout=10).json()


def unknown_fields(entry: dict) -> list[str]:
    """Keys of the received bodies that the route's SGLang request model does not have."""
    fields = set(entry["fields"])
    return sorted({k for body in entry["bodies"] for k in body} - fields)


def assert_contract(addr: str, path: str, model: str) -> dict:
    entry = _contract(addr).get(path)
    assert entry is not None, f"the client never sent a body to {path}"
    assert entry["model"] == model, f"SGLang binds {path} to {entry['model']}, not {model}"
    assert not unknown_fields(entry), f"{path}: fields unknown to SGLang's {model}: {unknown_fields(entry)}"
    return entry


def _client(servers, **kw) -> RemoteInferenceEngine:
    return RemoteInferenceEngine(servers, "sglang", timeout_s=60, retries=0, tp_sizes=TP, **kw)


def test_generate_single_and_batch(servers):
    eng = _client(servers[:1])
    g = GenerationConfig(max_new_tokens=3, min_new_tokens=1, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                         stop_token_ids=[0])

    async def go():
        one = await eng.agenerate(ModelRequest(input_ids=[5, 6, 7], gconfig=g))
        many = await eng.agenerate_group([ModelRequest(input_ids=[1, 2], gconfig=g.new(seed=s)) for s in (1, 2, 3)])
        return one, many

    one, many = asyncio.run(go())
    assert one.output_tokens == [8, 9, 10] and one.stop_reason == "length"
    assert [r.output_tokens for r in many] == [[3, 4, 5]] * 3
    entry = assert_contract(servers[0], "/generate", "GenerateReqInput")
    assert any(isinstance(b["input_ids"][0], list) for b in entry["bodies"])  # the batch form was sent


def test_bad_sampling_parameters_are_what_sglang_refuses(servers):
    """SGLang's contract gate refuses unknown sampling keys (400): the client must never send one."""
    body = sgl.build_generate([1, 2], GenerationConfig(max_new_tokens=2)).json
    body["sampling_params"]["min_tokens"] = 1  # vLLM's name
    r = httpx.post(f"http://{servers[0]}/generate", json=body, timeout=30)
    assert r.status_code == 400 and "min_tokens" in r.text
    # A resumed request has a smaller budget than its min_new_tokens; the payload clamps it.
    sp = sgl.sampling_params(GenerationConfig(max_new_tokens=8, min_new_tokens=6), max_new_tokens=2)
    assert sp["min_new_tokens"] <= sp["max_new_tokens"]


def test_pause_continue_and_disk_update(servers):
    eng = _client(servers)

    async def go():
        await eng.pause_generation()
        await eng.update_weights_from_disk(WeightUpdateMeta(type="disk", version=4, path="/ckpt/v4"))
        await eng.continue_generation()
        return await eng.get_server_versions()

    assert asyncio.run(go()) == {a: 4 for a in servers}  # read from /model_info
    for a in servers:
        assert_contract(a, "/pause_generation", "PauseGenerationReqInput")
        assert_contract(a, "/continue_generation", "ContinueGenerationReqInput")
        assert_contract(a, "/update_weights_from_disk", "UpdateWeightFromDiskReqInput")


def test_weight_version_and_memory_release(servers):
    eng = _client(servers[:1])

    async def go():
        await eng._all([sgl.build_set_version(11)], "update_weight_version")
        await eng.release_memory_occupation()
        released = httpx.get(f"http://{servers[0]}/_state").json()["memory_released"]
        await eng.resume_memory_occupation()
        return released, await eng.get_server_versions()

    released, versions = asyncio.run(go())
    assert released is True and versions == {servers[0]: 11}
    assert httpx.get(f"http://{servers[0]}/_state").json()["memory_released"] is False
    assert_contract(servers[0], "/update_weight_version", "UpdateWeightVersionReqInput")
    assert_contract(servers[0], "/release_memory_occupation", "ReleaseMemoryOccupationReqInput")
    assert_contract(servers[0], "/resume_memory_occupation", "ResumeMemoryOccupationReqInput")


def test_renamed_field_is_caught(servers):
    """The checks above can fail: a renamed required field is refused by SGLang itself, a renamed
    optional one is silently ignored by SGLang and caught by ``unknown_fields``."""
    meta = WeightUpdateMeta(type="distributed", version=1, master_port=1, world_size=5, group_name="g")
    body = sgl.build_init_group(meta, 1).json
    body["rank_ofset"] = body.pop("rank_offset")
    r = httpx.post(f"http://{servers[1]}/init_weights_update_group", json=body, timeout=30)
    assert r.status_code == 400 and "rank_offset" in r.text  # SGLang's validation error names the missing field
    disk = sgl.build_update_from_disk(WeightUpdateMeta(type="disk", version=2, path="/ckpt/v2")).json
    disk["weight_versions"] = disk.pop("weight_version")
    r = httpx.post(f"http://{servers[1]}/update_weights_from_disk", json=disk, timeout=30)
    assert r.status_code == 200  # SGLang does not notice ...
    assert "weight_versions" in unknown_fields(_contract(servers[1])["/update_weights_from_disk"])  # ... we do
    httpx.post(f"http://{servers[1]}/_forget", timeout=10)  # these bodies were wrong on purpose


def test_version_range_is_enforced(servers):
    eng = _client(servers)
    assert asyncio.run(eng.check_server_versions()) == {a: sglang_harness.SGLANG_VERSION for a in servers}
    with pytest.raises(InferenceError, match=r"sglang >=0\.5\.23,<0\.6\.0"):
        sgl.check_server_version({"version": "0.4.6.post5"}, "10.0.0.1:30000")
    with pytest.raises(InferenceError, match="reports version"):
        sgl.check_server_version({}, "10.0.0.1:30000")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g), "layer.0.norm": torch.randn(3, generator=g),
            "layer.0.step": torch.arange(5, dtype=torch.int64) * seed, "layer.0.proj": torch.randn(8, 8, generator=g),
            "lm_head.weight": torch.randn(16, 8, generator=g)}


@pytest.mark.parametrize("flat,wire", [(False, "float32"), (True, "float32"), (True, "bfloat16")])
def test_bucketed_push_to_sglang_receivers(servers, flat, wire, monkeypatch):
    """The project's sender → 2 servers × TP 2 (world size 5) that join with SGLang's helper and
    receive with SGLang's updater; every rank gets exactly the trainer's tensors."""
    # The trainer runs under torchrun, whose agent-store variable turns torch's tcp:// rendezvous
    # into a client of torchrun's store; the sender must still host the group's store.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    eng = _client(servers, flattened_bucket=flat)
    assert eng.weight_group_world_size == 1 + N_SERVERS * TP == 5
    version = {(False, "float32"): 21, (True, "float32"): 22, (True, "bfloat16"): 23}[(flat, wire)]
    tensors = _tensors(version)
    runner = LoopRunner()
    sender = DistributedSender(runner)
    # 600 bytes: several buckets; with bf16 on the wire the int64 tensor after the odd-sized norm
    # would sit at an unaligned offset of a flattened bucket, so it must open a new one.
    meta = WeightUpdateMeta(type="distributed", version=version, master_port=find_free_port(),
                            group_name=f"areal_contract_{version}", world_size=eng.weight_group_world_size,
                            bucket_bytes=600, dtype=wire, timeout_s=60)
    try:
        err = sender.send(meta, [eng], iter(tensors.items()), is_src=True)
        runner.run(eng.close())
    finally:
        sender.close()
        runner.close()
    assert err is None, err
    assert sender.last_seconds["buckets"] >= 2 and sender.last_seconds["flattened"] == float(flat)
    for a in servers:
        ranks = httpx.get(f"http://{a}/_received", timeout=30).json()
        assert len(ranks) == TP
        for rank in ranks:
            for name, t in tensors.items():
                want = t.to(getattr(torch, wire)) if t.is_floating_point() else t
                dtype, values = rank[name]
                assert dtype == str(want.dtype).removeprefix("torch."), name
                assert torch.equal(torch.tensor(values, dtype=torch.float64), want.double()), name
        state = httpx.get(f"http://{a}/_state").json()
        assert state == {"paused": False, "session": False, "weight_version": str(version), "memory_released": False,
                         "loras": {}}
        assert_contract(a, "/begin_weight_update", "BeginWeightUpdateReqInput")
        assert_contract(a, "/end_weight_update", "EndWeightUpdateReqInput")
        assert_contract(a, "/init_weights_update_group", "InitWeightsUpdateGroupReqInput")
        entry = assert_contract(a, "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput")
        if flat:
            flat_bodies = [b for b in entry["bodies"] if b.get("load_format") == "flattened_bucket"]
            assert flat_bodies
            if wire == "bfloat16":  # SGLang's receiver refuses misaligned tensors; the int64 one opened a bucket
                assert [b["names"][0] for b in flat_bodies if "layer.0.step" in b["names"]][-1] == "layer.0.step"
    inits = [b for b in _contract(servers[1])["/init_weights_update_group"]["bodies"] if "rank_offset" in b]
    assert inits[-1]["rank_offset"] == 1 + TP and inits[-1]["world_size"] == 5
    assert asyncio.run(eng.get_server_versions()) == {a: version for a in servers}


def test_launch_argv_parses_with_sglangs_own_parser():
    """Every flag launch.py emits for SGLang (p included, plus launcher.server_args) is one
    ``sglang.launch_server`` accepts: parsed by SGLang's own ``ServerArgs.add_cli_args``."""
    _require_sglang()
    from areal_cli.inference.launch import build_server_cmd

    argv, env = build_server_cmd("sglang", "/m", "127.0.0.1", 30000, tp=2, pp=2, dtype="bf16", device="cuda",
                                 seed=5, api_key="k", context_length=2048,
                                 extra=["--mem-fraction-static", "0.8", "--trust-remote-code", "--enable-memory-saver"])
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    code = ("import argparse, json, sys; import sglang_harness; sglang_harness.bootstrap(); "
            "from sglang.srt.server_args import ServerArgs; p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p); "
            "ns = p.parse_args(json.loads(sys.argv[1])); "
            "print(json.dumps({k: getattr(ns, k) for k in ('tp_size', 'pp_size', 'dtype', 'random_seed', 'device', "
            "'context_length', 'mem_fraction_static', 'trust_remote_code', 'enable_memory_saver', "
            "'skip_server_warmup', 'api_key')}))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argv[3:])], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SUPPORT)}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ns = json.loads(out.stdout.strip().splitlines()[-1])
    assert ns == {"tp_size": 2, "pp_size": 2, "dtype": "bfloat16", "random_seed": 5, "device": "cuda",
                  "context_length": 2048, "mem_fraction_static": 0.8, "trust_remote_code": True,
                  "enable_memory_saver": True, "skip_server_warmup": True, "api_key": "k"}


def test_lora_adapter_versions_and_per_request_name(servers):
    """Adapter-only sync into SGLang (weight_sync/lora.py): the first version is a load, later ones pause →
    unload → load → version → continue (SGLang refuses a second load under a loaded name); every generate
    names the adapter in ``lora_path``. Checked against SGLang's own routes and request models."""
    addr = servers[0]
    eng = _client([addr], lora_name="areal-policy")
    g = GenerationConfig(max_new_tokens=2)

    async def go():
        await eng.load_lora_adapter("areal-policy", "/ckpt/lora/v1", 1)
        await eng.load_lora_adapter("areal-policy", "/ckpt/lora/v2", 2)
        one = await eng.agenerate(ModelRequest(input_ids=[5, 6, 7], gconfig=g))
        reqs = [ModelRequest(input_ids=[1, 2], gconfig=g.new(seed=s)) for s in (1, 2)]
        many = await eng.agenerate_group(reqs)
        return one, many, await eng.get_server_versions()

    one, many, versions = asyncio.run(go())
    assert one.output_tokens and len(many) == 2 and versions == {addr: 2}
    state = httpx.get(f"http://{addr}/_state", timeout=10).json()
    assert state["loras"] == {"areal-policy": "/ckpt/lora/v2"} and state["paused"] is False
    assert_contract(addr, "/load_lora_adapter", "LoadLoRAAdapterReqInput")
    assert_contract(addr, "/unload_lora_adapter", "UnloadLoRAAdapterReqInput")
    entry = assert_contract(addr, "/generate", "GenerateReqInput")
    assert any(b.get("lora_path") == "areal-policy" for b in entry["bodies"])
    # SGLang refuses a request naming an adapter it never loaded: the name really is checked.
    body = sgl.build_generate([1, 2], g, lora="never-loaded").json
    r = httpx.post(f"http://{addr}/generate", json=body, timeout=30)
    assert r.status_code == 400 and "never been loaded" in r.text


def test_image_data_is_what_sglang_takes(servers):
    """Images travel in SGLang's own ``image_data`` field: a list of images for one prompt, a list of lists
    (``[]`` for a prompt without images) for a batch, which SGLang's normalisation keeps per prompt."""
    url = "data:image/png;base64,iVBORw0KGgo="
    g = GenerationConfig(max_new_tokens=2)
    one = httpx.post(f"http://{servers[1]}/generate", json=sgl.build_generate([1, 2], g, image_data=[url]).json,
                     timeout=30)
    assert one.status_code == 200, one.text
    assert one.json()["meta_info"]["harness_image_data"] == [url]
    body = sgl.build_generate_batch([[1], [2], [3]], [g] * 3, [2] * 3, image_data=[[url], None, [url, url]]).json
    many = httpx.post(f"http://{servers[1]}/generate", json=body, timeout=30)
    assert many.status_code == 200, many.text
    assert [r["meta_info"].get("harness_image_data") for r in many.json()] == [[url], [], [url, url]]
    assert "image_data" not in sgl.build_generate_batch([[1]], [g], [2], image_data=[None]).json

    eng = _client(servers[1:])

    async def go():
        a = await eng.agenerate(ModelRequest(input_ids=[5, 6], gconfig=g, image_data=[url]))
        b = await eng.agenerate_group([ModelRequest(input_ids=[7], gconfig=g, image_data=[url]),
                                       ModelRequest(input_ids=[8], gconfig=g)])
        c = await eng.agenerate(ModelRequest(input_ids=[9], gconfig=g))
        # an expanded image prompt goes out with one pad per image; its input_tokens stay the expanded ids
        d = await eng.agenerate_group([ModelRequest(input_ids=[5, 77, 77, 77, 6], gconfig=g, image_data=[url],
                                                    image_pad_id=77)] * 2)
        return a, b, c, d

    a, b, c, d = asyncio.run(go())
    assert [r.input_tokens for r in d] == [[5, 77, 77, 77, 6]] * 2
    assert a.input_tokens == [5, 6] and a.output_tokens == [7, 8]  # SGLang reports no expanded prompt
    assert [r.output_tokens for r in b] == [[8, 9], [9, 10]] and c.output_tokens == [10, 11]
    entry = assert_contract(servers[1], "/generate", "GenerateReqInput")
    sent = [x.get("image_data") for x in entry["bodies"]]
    assert [url] in sent and [[url], []] in sent
    assert [[5, 77, 6], [5, 77, 6]] in [x["input_ids"] for x in entry["bodies"]]


_EXPAND = """
import json, sys
import sglang_harness
sglang_harness.bootstrap()
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor as B
a = json.loads(sys.stdin.read())
out = {"one_pad": B._expand_input_ids(a["sent"], a["counts"], a["pad"])}
try:
    B._expand_input_ids(a["expanded"], a["counts"], a["pad"])
    out["exact_runs"] = "accepted"
except ValueError as e:
    out["exact_runs"] = str(e)
print(json.dumps(out))
"""


def test_image_prompt_is_what_sglang_expands(tmp_path):
    """What the sglang builder sends for an image prompt, run through SGLang 0.5.23's own expansion of an
    ``input_ids`` prompt (``BaseMultimodalProcessor._expand_input_ids``, with the counts SGLang takes from the HF
    processor's ``_get_num_multimodal_tokens``, as its ``resolve_image_token_counts`` does), is the expanded
    prompt the trainer's row holds (models/vl_inputs.py), for two images of different sizes placed mid-text.
    The processor-expanded form (a run of each image's exact count) is what SGLang's check refuses (it then
    falls back to re-tokenizing the decoded text): why the builder sends one pad per image."""
    _require_sglang()
    import io

    from PIL import Image
    from transformers import AutoTokenizer

    from areal_cli.data.builtin_model import ensure_builtin_model
    from areal_cli.models import vl_inputs as I
    from areal_cli.models.tiny_vl import load_vl_processor

    vl_dir = str(ensure_builtin_model(tmp_path / "fileroot", "tiny_vl"))
    tok, proc = AutoTokenizer.from_pretrained(vl_dir), load_vl_processor(vl_dir)
    sizes = [(64, 64), (48, 32)]  # (width, height)
    pngs = []
    for w, h in sizes:
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (200, 20, 20)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    msgs = [{"role": "user", "content": [{"type": "text", "text": "How many"}, {"type": "image"},
                                         {"type": "text", "text": "and"}, {"type": "image"}]}]
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    vis = I.prompt_images(tok, ids, pngs)
    counts = [int(n) for n in proc._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes]).num_image_tokens]
    assert counts == [16, 6] and vis.ids.count(vis.pad_id) == 22  # the processor's own counts, per image
    g = GenerationConfig(max_new_tokens=2)
    sent = sgl.build_generate(vis.ids, g, image_data=vis.image_data, image_pad_id=vis.pad_id).json["input_ids"]
    assert sent.count(vis.pad_id) == 2
    batch = sgl.build_generate_batch([vis.ids, [1, 2]], [g] * 2, [2] * 2, image_data=[vis.image_data, None],
                                     image_pad_id=vis.pad_id).json["input_ids"]
    assert batch == [sent, [1, 2]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SUPPORT), *sys.path])}
    res = subprocess.run([sys.executable, "-c", _EXPAND], input=json.dumps(
        {"sent": sent, "expanded": vis.ids, "counts": counts, "pad": vis.pad_id}), capture_output=True, text=True,
        env=env, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["one_pad"] == vis.ids
    assert "image placeholder token(s) but 2 image(s)" in out["exact_runs"]
    with pytest.raises(InferenceError, match="3 image placeholder run"):  # a generated pad in a resumed prompt
        sgl.build_generate([*vis.ids, vis.pad_id], g, image_data=vis.image_data, image_pad_id=vis.pad_id)


def test_vl_sync_names_are_the_ones_sglang_loads():
    """SGLang's Qwen2_5_VLForConditionalGeneration (srt/models/qwen2_5_vl.py, 0.5.23) has ``model.*``,
    ``lm_head.*`` and ``visual.*`` parameters, and its ``load_weights`` (every update route ends there:
    from_distributed, from_tensor, from_disk) maps ``visual.*.attn.qkv.`` to ``qkv_proj`` and stacks q/k/v and
    gate/up, and silently skips a name its module tree lacks. The trainer's VL sender names a weight as the hub
    checkpoint does (engines/vision.py hub_name); checked here against the names SGLang's own module tree has,
    read from its source, so a transformers-5 module name (``model.language_model.*``) would fail."""
    _require_sglang()
    import re

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from areal_cli.engines.vision import hub_name

    src = (sglang_harness.sglang_path() / "sglang" / "srt" / "models" / "qwen2_5_vl.py").read_text()
    cls = src[src.index("class Qwen2_5_VLForConditionalGeneration"):]
    tops = set(re.findall(r'prefix=add_prefix\("(\w+)", prefix\)', cls[:cls.index("def load_weights")]))
    assert {"model", "lm_head", "visual"} <= tops, tops
    assert 'name.replace(r"attn.qkv.", r"attn.qkv_proj.")' in cls
    cfg = Qwen2_5_VLConfig(text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
                                        "tie_word_embeddings": False,
                                        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
                           vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                                          "out_hidden_size": 32, "patch_size": 4, "fullatt_block_indexes": [0]})
    names = [hub_name(n) for n in Qwen2_5_VLForConditionalGeneration(cfg).state_dict()]
    assert names and all(n.split(".")[0] in tops for n in names), [n for n in names if n.split(".")[0] not in tops]
    assert any(".attn.qkv." in n for n in names if n.startswith("visual."))  # the name load_weights renames
    assert "lm_head.weight" in names and not any(n.startswith(("model.visual.", "model.language_model."))
                                                 for n in names)
