"""LoRA adapters in a real ``hf`` server: SGLang's ``/load_lora_adapter`` / ``/unload_lora_adapter`` and the
per-request ``lora_path``, against peft's own adapters and peft's own merge.

Greedy output with an adapter equals HF transformers' greedy output of ``merge_and_unload()`` of the same
peft model; a batch mixing adapters and the base gives each row its own; bad adapters, names and paths
get a 4xx and the server keeps serving.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from hf_server_helpers import hf_greedy, load_model, prompts, start_hf_server  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_NEW = 12


def _peft_adapter(model_dir: str, out: Path, r: int, targets: list[str], seed: int):
    """A peft adapter with random (non-zero) B, saved by peft; returns (dir, peft's merged model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_model(model_dir), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out))
    return out, model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("adapters")
    a_dir, merged_a = _peft_adapter(tiny_model_dir, root / "a", 4, ALL, seed=1)
    b_dir, merged_b = _peft_adapter(tiny_model_dir, root / "b", 2, ["q_proj", "v_proj"], seed=2)
    _peft_adapter(tiny_model_dir, root / "r8", 8, ["q_proj"], seed=3)
    ps = prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 3)
    server = start_hf_server(tiny_model_dir, tmp_path_factory, extra=["--max-lora-rank", "4"])
    try:
        yield {"server": server, "a": str(a_dir), "b": str(b_dir), "root": root, "prompts": ps,
               "want_a": [hf_greedy(merged_a, p, N_NEW) for p in ps],
               "want_b": [hf_greedy(merged_b, p, N_NEW) for p in ps],
               "want_base": [hf_greedy(load_model(tiny_model_dir), p, N_NEW) for p in ps]}
    finally:
        server.stop()


def _post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://{s['server'].address}{path}", json=body, timeout=120)


def _gen(s, ids, lora=None, **extra) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0.0}, **extra}
    if lora is not None:
        body["lora_path"] = lora
    return _post(s, "/generate", body)


def _tokens(resp: httpx.Response):
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return [x["output_ids"] for x in out] if isinstance(out, list) else out["output_ids"]


def test_adapter_greedy_equals_merged_model(setup):
    s = setup
    r = _post(s, "/load_lora_adapter", {"lora_name": "a", "lora_path": s["a"]})
    assert r.status_code == 200 and r.json()["success"] and "a" in r.json()["loaded_adapters"], r.text
    assert _post(s, "/load_lora_adapter", {"lora_name": "b", "lora_path": s["b"]}).status_code == 200
    assert s["want_a"] != s["want_base"] and s["want_b"] != s["want_base"], "adapters too weak to test"
    for p, wa, wb, w0 in zip(s["prompts"], s["want_a"], s["want_b"], s["want_base"]):
        assert _tokens(_gen(s, p, "a")) == wa
        assert _tokens(_gen(s, p, "b")) == wb
        assert _tokens(_gen(s, p)) == w0
    # One batch, three rows: adapter a, the base, adapter b (SGLang's list form of lora_path).
    ps = s["prompts"]
    got = _tokens(_gen(s, [ps[0], ps[1], ps[2]], ["a", None, "b"]))
    assert got == [s["want_a"][0], s["want_base"][1], s["want_b"][2]]
    # The same prompt under two adapters in one batch is not shared-prefilled across them.
    assert _tokens(_gen(s, [ps[0], ps[0]], ["a", "b"])) == [s["want_a"][0], s["want_b"][0]]


def test_replace_advances_version_and_unload(setup):
    s = setup
    _post(s, "/load_lora_adapter", {"lora_name": "r", "lora_path": s["a"]})
    assert _tokens(_gen(s, s["prompts"][0], "r")) == s["want_a"][0]
    r = _post(s, "/load_lora_adapter", {"lora_name": "r", "lora_path": s["b"], "replace": True,
                                        "weight_version": "7"})
    assert r.status_code == 200, r.text
    assert httpx.get(f"http://{s['server'].address}/model_info").json()["weight_version"] == "7"
    assert _tokens(_gen(s, s["prompts"][0], "r")) == s["want_b"][0]
    assert _post(s, "/unload_lora_adapter", {"lora_name": "r"}).status_code == 200
    r = _gen(s, s["prompts"][0], "r")
    assert r.status_code == 400 and "not loaded" in r.text


def _corrupt(src: str, dst: Path, *, tensors=None, config=None) -> str:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(src) / "adapter_config.json").read_text())
    t = load_file(str(Path(src) / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    save_file(tensors(t) if tensors else t, str(dst / "adapter_model.safetensors"))
    return str(dst)


def _reshape_first_a(t: dict) -> dict:
    k = next(k for k in t if "lora_A" in k)
    return {**t, k: torch.zeros(t[k].shape[0], t[k].shape[1] + 3)}


def _unknown_module(t: dict) -> dict:
    out = dict(t)
    for k in [k for k in t if "layers.0.self_attn.q_proj." in k]:
        out[k.replace("q_proj", "nope_proj")] = out.pop(k)
    return out


@pytest.mark.parametrize("case", ["wrong_rank", "rank_above_max", "wrong_shape", "unknown_module",
                                  "missing_name", "outside_roots", "missing_dir", "duplicate",
                                  "unload_unknown", "generate_unknown"])
def test_bad_input_is_4xx_and_server_keeps_serving(setup, case, tmp_path):
    s = setup
    root = s["root"]
    if case == "wrong_rank":  # the config says r=8, the tensors have rank 4
        path = _corrupt(s["a"], root / case, config=lambda c: {**c, "r": 8})
        r = _post(s, "/load_lora_adapter", {"lora_name": case, "lora_path": path})
    elif case == "rank_above_max":  # the server was started with --max-lora-rank 4
        r = _post(s, "/load_lora_adapter", {"lora_name": case, "lora_path": str(root / "r8")})
        assert "max-lora-rank" in r.text
    elif case == "wrong_shape":
        path = _corrupt(s["a"], root / case, tensors=_reshape_first_a)
        r = _post(s, "/load_lora_adapter", {"lora_name": case, "lora_path": path})
    elif case == "unknown_module":
        path = _corrupt(s["a"], root / case, tensors=_unknown_module)
        r = _post(s, "/load_lora_adapter", {"lora_name": case, "lora_path": path})
    elif case == "missing_name":
        r = _post(s, "/load_lora_adapter", {"lora_path": s["a"]})
    elif case == "outside_roots":
        r = _post(s, "/load_lora_adapter", {"lora_name": case, "lora_path": os.path.realpath("/usr/share")})
    elif case == "missing_dir":
        r = _post(s, "/load_lora_adapter", {"lora_name": case, "lora_path": str(root / "does_not_exist")})
    elif case == "duplicate":
        _post(s, "/load_lora_adapter", {"lora_name": "dup", "lora_path": s["a"]})
        r = _post(s, "/load_lora_adapter", {"lora_name": "dup", "lora_path": s["b"]})
        _post(s, "/unload_lora_adapter", {"lora_name": "dup"})
    elif case == "unload_unknown":
        r = _post(s, "/unload_lora_adapter", {"lora_name": "never_loaded"})
    else:
        r = _gen(s, s["prompts"][0], "never_loaded")
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text)
    body = r.json()
    assert body["success"] is False or "error" in body
    if case == "outside_roots":
        assert r.status_code == 403
    names = httpx.get(f"http://{s['server'].address}/health", timeout=30)
    assert names.status_code == 200
    assert _tokens(_gen(s, s["prompts"][1])) == s["want_base"][1]


@pytest.mark.slow  # a second server; the hooks are the path CUDA servers take
def test_hf_forward_runner_applies_adapters_too(setup, tiny_model_dir, tmp_path_factory):
    """With HF's own forward (``--stock-attention``: no fast path, as on CUDA) the adapter goes in through
    forward hooks on the adapted linears; the same greedy tokens as peft's merged model."""
    s = dict(setup)
    s["server"] = start_hf_server(tiny_model_dir, tmp_path_factory, extra=["--stock-attention"])
    try:
        log = Path(s["server"].log_path).read_text()
        assert "decode path: HF forward" in log, log[-2000:]
        assert _post(s, "/load_lora_adapter", {"lora_name": "a", "lora_path": s["a"]}).status_code == 200
        ps = s["prompts"]
        assert _tokens(_gen(s, ps[0], "a")) == s["want_a"][0]
        assert _tokens(_gen(s, [ps[1], ps[2]], ["a", None])) == [s["want_a"][1], s["want_base"][2]]
    finally:
        s["server"].stop()
