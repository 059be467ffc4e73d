"""Payload builders/parsers of each backend: values, paths and vLLM's schema.

SGLang's payloads are checked against SGLang's own request models and routes in
tests/integration/inference/test_sglang_contract.py (sglang installed by scripts/setup_sglang_contract.sh);
here only their values. The vLLM field sets below are copied from vLLM 0.32's
``entrypoints/openai/completion/protocol.py`` and ``entrypoints/rl/online/api_router.py``.
"""

from __future__ import annotations

import pytest

from areal_cli.api.io_struct import GenerationConfig, ParamSpec, WeightUpdateMeta
from areal_cli.errors import ConfigError, InferenceError
from areal_cli.inference.backends import get_backend, hf, sglang, vllm

VLLM_COMPLETION_FIELDS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                          "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                          "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
                          "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
                          "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
                          "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "add_special_tokens",
                          "response_format", "priority", "request_id", "return_tokens_as_token_ids",
                          "return_token_ids", "bad_words", "cache_salt", "kv_transfer_params"}
NCCL_INIT_INFO = {"master_address", "master_port", "rank_offset", "world_size"}
NCCL_UPDATE_INFO = {"names", "dtype_names", "shapes"}

G = GenerationConfig(temperature=0.8, top_p=0.95, top_k=20, max_new_tokens=50, min_new_tokens=2,
                     stop=["</s>"], stop_token_ids=[7])
META = WeightUpdateMeta(type="distributed", version=4, path="/ckpt/v4", master_address="10.0.0.1",
                        master_port=29555, group_name="g", backend="gloo", world_size=3)
SPECS = [ParamSpec("a.weight", "float32", [2, 3]), ParamSpec("b.bias", "bfloat16", [3])]


def test_sglang_generate_payload_matches_schema():
    call = sglang.build_generate([1, 2, 3], G, max_new_tokens=10, rid="r1")
    assert (call.method, call.path) == ("POST", "/generate")
    assert call.json["input_ids"] == [1, 2, 3] and call.json["return_logprob"] is True and call.json["rid"] == "r1"
    sp = call.json["sampling_params"]
    assert sp == {"max_new_tokens": 10, "min_new_tokens": 2, "temperature": 0.8, "top_p": 0.95, "top_k": 20,
                  "stop": ["</s>"], "stop_token_ids": [7]}
    greedy = sglang.build_generate([1], G.new(greedy=True)).json["sampling_params"]
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 1
    assert sglang.build_generate([1], G.new(top_k=-1)).json["sampling_params"]["top_k"] == -1


def test_sglang_parse_generate_variants():
    resp = {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "id": "x", "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
        "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}
    seg = sglang.parse_generate(resp, fallback_version=0)
    assert (seg.output_tokens, seg.output_logprobs, seg.output_versions, seg.finish, seg.version) == (
        [5, 6], [-0.5, -1.5], [3, 3], "length", 3)
    resp["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}
    resp["meta_info"]["weight_version"] = "default"  # SGLang's initial tag is not an int
    seg = sglang.parse_generate(resp, fallback_version=9)
    assert seg.finish == "abort" and seg.output_versions == [9, 9] and seg.version is None
    resp["meta_info"]["output_token_weight_versions"] = [1, 2]  # hf-server extension wins
    assert hf.parse_generate(resp).output_versions == [1, 2]
    with pytest.raises(InferenceError, match="finish_reason"):
        sglang.parse_generate({"meta_info": {"finish_reason": {"type": "weird"}, "output_token_logprobs": []}})
    with pytest.raises(InferenceError, match="malformed"):
        sglang.parse_generate({"nope": 1})
    with pytest.raises(InferenceError, match="return_logprob"):
        sglang.parse_generate({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})


def test_sglang_weight_update_payloads():
    d = sglang.build_update_from_disk(META)
    assert d.path == "/update_weights_from_disk"
    assert d.json["model_path"] == "/ckpt/v4" and d.json["weight_version"] == "4"
    i = sglang.build_init_group(META, 2)
    assert i.path == "/init_weights_update_group"
    assert i.json["rank_offset"] == 2 and i.json["world_size"] == 3 and i.json["backend"] == "gloo"
    assert sglang.group_ranks([2, 2]) == ([1, 3], 5) and sglang.group_ranks([1, 4, 2]) == ([1, 2, 6], 8)
    u = sglang.build_update_distributed(META, SPECS)
    assert u.path == "/update_weights_from_distributed" and "load_format" not in u.json
    assert sglang.build_update_distributed(META, SPECS, flattened_bucket=True).json["load_format"] == "flattened_bucket"
    assert u.json["names"] == ["a.weight", "b.bias"] and u.json["dtypes"] == ["float32", "bfloat16"]
    assert u.json["shapes"] == [[2, 3], [3]] and u.json["weight_version"] == "4"
    assert sglang.build_pause().path == "/pause_generation" and sglang.build_pause().json == {"mode": "abort"}
    assert sglang.build_continue().path == "/continue_generation"
    assert sglang.parse_version({"weight_version": "12"}) == 12 and sglang.build_get_version().path == "/model_info"
    assert sglang.build_begin_update().path == "/begin_weight_update"
    assert sglang.build_end_update().path == "/end_weight_update"
    with pytest.raises(InferenceError):
        sglang.build_update_from_disk(WeightUpdateMeta(type="disk", path=None))
    with pytest.raises(InferenceError, match="failed"):
        sglang.check_ok({"success": False, "message": "bad shapes"}, "update")


def test_vllm_completion_payload_matches_schema():
    call = vllm.build_generate([1, 2, 3], G, model="m", max_new_tokens=9, rid="r")
    assert (call.method, call.path) == ("POST", "/v1/completions")
    assert set(call.json) <= VLLM_COMPLETION_FIELDS
    j = call.json
    assert j["prompt"] == [1, 2, 3] and j["model"] == "m" and j["max_tokens"] == 9 and j["min_tokens"] == 2
    assert j["logprobs"] == 0 and j["return_token_ids"] is True and j["top_k"] == 20
    assert j["stop"] == ["</s>"] and j["stop_token_ids"] == [7] and j["include_stop_str_in_output"] is True
    g = vllm.build_generate([1], G.new(greedy=True), model="m").json
    assert g["temperature"] == 0.0 and g["top_k"] == -1


def test_vllm_parse_completion():
    resp = {"choices": [{"index": 0, "text": "xy", "finish_reason": "length", "token_ids": [11, 12],
                         "logprobs": {"tokens": ["x", "y"], "token_logprobs": [-0.1, -0.2],
                                      "top_logprobs": [None, None], "text_offset": [0, 1]}}]}
    seg = vllm.parse_generate(resp, fallback_version=5)
    assert (seg.output_tokens, seg.output_logprobs, seg.output_versions, seg.finish) == (
        [11, 12], [-0.1, -0.2], [5, 5], "length")
    del resp["choices"][0]["token_ids"]
    resp["choices"][0]["logprobs"]["tokens"] = ["token_id:11", "token_id:12"]
    resp["choices"][0]["finish_reason"] = "abort"
    seg = vllm.parse_generate(resp)
    assert seg.output_tokens == [11, 12] and seg.finish == "abort"
    resp["choices"][0]["logprobs"]["token_logprobs"] = [-0.1]
    with pytest.raises(InferenceError, match="logprobs"):
        vllm.parse_generate(resp)
    assert vllm.parse_model_name({"object": "list", "data": [{"id": "tiny"}]}) == "tiny"


def test_vllm_rl_endpoints():
    p = vllm.build_pause()
    assert (p.path, p.params) == ("/pause", {"mode": "abort"})
    assert vllm.build_continue().path == "/resume"
    rpc, reset, reset_enc, ver = vllm.build_update_from_disk(META)
    assert rpc.path == "/collective_rpc" and reset.path == "/reset_prefix_cache"
    assert reset_enc.path == "/reset_encoder_cache"  # vision-tower outputs of the old weights
    # the worker extension's reload (inference/vllm_worker_ext.py), which the launcher mixes into every server
    assert rpc.json == {"method": "areal_reload_weights", "kwargs": {"weights_path": "/ckpt/v4"}}
    from areal_cli.inference.vllm_worker_ext import ArealWorkerExtension

    assert callable(getattr(ArealWorkerExtension, rpc.json["method"]))
    assert (ver.path, ver.json) == ("/update_weight_version", {"new_version": "4"})
    init = vllm.build_init_group(META, 1)
    assert init.path == "/init_weight_transfer_engine" and set(init.json) == {"init_info"}
    assert set(init.json["init_info"]) == NCCL_INIT_INFO and init.json["init_info"]["rank_offset"] == 1
    start, upd, fin, reset = vllm.build_update_distributed(META, SPECS)
    assert reset.path == "/reset_prefix_cache"
    assert [start.path, upd.path, fin.path] == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert set(upd.json["update_info"]) == NCCL_UPDATE_INFO
    assert upd.json["update_info"]["dtype_names"] == ["float32", "bfloat16"]
    assert fin.json == {"weight_version": "4"}
    assert vllm.build_get_version().path == "/weight_info" and vllm.parse_version({"weight_version": "4"}) == 4


def test_get_backend():
    assert get_backend("hf") is hf and get_backend("vllm") is vllm
    with pytest.raises(ConfigError):
        get_backend("tgi")


@pytest.mark.parametrize("backend", [hf, sglang, vllm], ids=lambda m: m.NAME)
def test_every_backend_provides_the_client_interface(backend):
    """The client calls these members on any backend without asking which it is (no name checks,
    no hasattr): each backend declares every capability and provides what its capabilities need."""
    from areal_cli.inference.backends.base import CAPABILITY_MEMBERS, INTERFACE

    missing = [m for m in INTERFACE if not hasattr(backend, m)]
    for flag, members in CAPABILITY_MEMBERS.items():
        if getattr(backend, flag):
            missing += [m for m in members if not hasattr(backend, m)]
    assert not missing, missing
    for flag in [m for m in INTERFACE if m.startswith(("SUPPORTS_", "NEEDS_"))]:
        assert isinstance(getattr(backend, flag), bool), flag
    assert backend.is_transient_rejection(500, "boom") is False


def test_a_lora_adapter_is_named_in_the_request_of_every_backend():
    assert vllm.build_generate([1], G, model="base", lora="adapter").json["model"] == "adapter"
    assert vllm.build_generate([1], G, model="base").json["model"] == "base"
    assert sglang.build_generate([1], G, lora="adapter").json["lora_path"] == "adapter"
    with pytest.raises(ValueError, match="model name"):
        vllm.build_generate([1], G)


def test_images_in_generate_payloads():
    url = "data:image/png;base64,iVBORw0KGgo="
    assert sglang.build_generate([1, 2], G, image_data=[url]).json["image_data"] == [url]
    assert "image_data" not in sglang.build_generate([1, 2], G).json
    batch = sglang.build_generate_batch([[1], [2]], [G, G], [3, 3], image_data=[None, [url]]).json
    assert batch["image_data"] == [[], [url]]  # a list per prompt: SGLang reads a bare first entry as one image
    assert hf.build_generate([1], G, image_data=[url]).json["image_data"] == [url]
    # vLLM's /v1/completions has no field for images (VLLM_COMPLETION_FIELDS): a prompt with images goes to its
    # token-in route with one pad per image, since vLLM expands each pad itself (vLLM's models: test_vllm_contract)
    call = vllm.build_generate([1, 9, 9, 9, 5, 9, 2], G, model="m", image_data=[url, url], image_pad_id=9)
    assert call.path == vllm.GENERATE_TOKENS_PATH and call.json["token_ids"] == [1, 9, 5, 9, 2]
    assert call.json["content_parts"] == [{"type": "image_url", "url": url}] * 2
    with pytest.raises(InferenceError, match="1 image placeholder run"):
        vllm.build_generate([1, 9, 9, 2], G, model="m", image_data=[url, url], image_pad_id=9)
    with pytest.raises(ValueError, match="image pad id"):
        vllm.build_generate([1, 9, 2], G, model="m", image_data=[url])
    assert set(vllm.build_generate([1], G, model="m").json) <= VLLM_COMPLETION_FIELDS


def test_parse_generate_reads_the_expanded_prompt():
    resp = {"output_ids": [4], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "1",
                                             "output_token_logprobs": [[-0.1, 4, None]],
                                             "prompt_token_ids": [1, 9, 9, 9, 2]}}
    assert sglang.parse_generate(resp).prompt_ids == [1, 9, 9, 9, 2]
    del resp["meta_info"]["prompt_token_ids"]
    assert sglang.parse_generate(resp).prompt_ids is None
    # vLLM's /inference/v1/generate answer (a prompt with images); /v1/completions reports no prompt
    gen = {"prompt_token_ids": [1, 9, 9, 9, 2], "choices": [{"token_ids": [4, 5], "finish_reason": "length",
           "logprobs": {"content": [{"token_id": 4, "logprob": -0.1}, {"token_id": 5, "logprob": -0.2}]}}]}
    seg = vllm.parse_generate(gen)
    assert (seg.prompt_ids, seg.output_tokens, seg.output_logprobs) == ([1, 9, 9, 9, 2], [4, 5], [-0.1, -0.2])
    cmpl = {"choices": [{"token_ids": [4], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1]}}]}
    assert vllm.parse_generate(cmpl).prompt_ids is None
