"""HTTP fuzzing of the built-in ``hf`` server (issue 22, item 13).

Hypothesis posts malformed and adversarial bodies to the generation endpoints (``/generate``,
``/v1/completions``, ``/v1/chat/completions``) and the admin endpoints: wrong types, huge numbers, NaN
and infinities, negative counts, deep nesting, huge strings, unicode, invalid JSON and non-objects.
Every answer must be a 2xx, or a 4xx whose JSON body carries a message; never a 5xx, never a dropped
connection. At the end the server still answers a correct request. ``AREAL_FUZZ_EXAMPLES`` overrides
the number of examples (default 2000).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hf_server_helpers import start_hf_server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

N_EXAMPLES = int(os.environ.get("AREAL_FUZZ_EXAMPLES", "2000"))
GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")
ADMIN = ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weight_version",
         "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
         "/update_weights_from_distributed")

# --- values ----------------------------------------------------------------------------------------

huge_ints = st.sampled_from([2**31, 2**63, 2**64 + 1, 10**30, -(2**63) - 1, -10**30])
weird_floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, 1e-40,
                                -0.0])
small_ints = st.integers(min_value=-5, max_value=40)
texts = st.text(max_size=40) | st.sampled_from(["", " ", "\x00", "\ud7ff\ue000", "😀" * 20, "a" * 20000,
                                                "<|im_start|>", "\\u0000", "NaN"])
scalars = (st.none() | st.booleans() | small_ints | huge_ints | st.floats(allow_nan=True, allow_infinity=True)
           | weird_floats | texts)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
token_ids = st.lists(small_ints | huge_ints | st.sampled_from([-1, 10**6]), min_size=0, max_size=12)
good_ids = st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=8)


def maybe(key: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.just({}), values.map(lambda v: {key: v}))


def merge(parts: list[dict]) -> dict:
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


def plausible(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Objects with the endpoint's own keys, each present or not, valid-looking or not."""
    return st.tuples(*[maybe(k, v | json_values) for k, v in fields.items()]).map(list).map(merge)


sampling = plausible({
    "max_new_tokens": st.integers(-3, 8) | huge_ints, "min_new_tokens": st.integers(-3, 8) | huge_ints,
    "temperature": st.floats(-2, 3) | weird_floats, "top_p": st.floats(-1, 2) | weird_floats,
    "top_k": st.integers(-3, 100) | huge_ints, "stop": texts | st.lists(texts, max_size=3),
    "stop_token_ids": token_ids, "ignore_eos": st.booleans(), "sampling_seed": small_ints | huge_ints,
    "n": small_ints | huge_ints, "repetition_penalty": st.floats(0, 2) | weird_floats,
})
generate_bodies = plausible({
    "input_ids": good_ids | token_ids | st.lists(good_ids, min_size=1, max_size=3),
    "text": texts | st.lists(texts, max_size=3), "sampling_params": sampling | st.lists(sampling, max_size=3),
    "return_logprob": st.booleans(), "stream": st.booleans(), "rid": texts, "top_logprobs_num": small_ints,
})
openai_common = {
    "max_tokens": st.integers(-3, 8) | huge_ints, "temperature": st.floats(-2, 3) | weird_floats,
    "top_p": st.floats(-1, 2) | weird_floats, "top_k": small_ints | huge_ints,
    "n": st.integers(-2, 3) | huge_ints, "stop": texts | st.lists(texts, max_size=3),
    "stop_token_ids": token_ids, "min_tokens": st.integers(-3, 8),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "logprobs": st.booleans() | small_ints,
}
completion_bodies = plausible({**openai_common, "prompt": texts | good_ids | token_ids,
                               "echo": st.booleans()})
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | texts,
                                           "content": texts}) | json_values, max_size=3)
chat_bodies = plausible({**openai_common, "messages": messages, "max_completion_tokens": st.integers(-3, 8),
                         "top_logprobs": small_ints})
admin_bodies = plausible({
    "mode": st.sampled_from(["abort", "in_place", ""]) | texts, "new_version": small_ints | huge_ints | texts,
    "weight_version": small_ints | huge_ints | texts,
    "model_path": texts | st.sampled_from(["/", ".", "/proc"]),
    "load_format": st.sampled_from(["auto", "safetensors", "pt"]),
    "master_address": st.sampled_from(["", "256.1.1.1"]) | texts, "master_port": st.integers(-1, 70000),
    "rank_offset": st.integers(-2, 4), "world_size": st.integers(-2, 4), "group_name": texts,
    # joins that pass validation try to reach the (absent) master: keep their wait short
    "timeout_s": st.floats(0.01, 0.3) | st.sampled_from([0, -1, 10**9]) | weird_floats,
    "names": st.lists(texts, max_size=3),
    "dtypes": st.lists(st.sampled_from(["float32", "bf16", "x"]), max_size=3),
    "shapes": st.lists(st.lists(st.integers(-2, 10**6), max_size=3), max_size=3),
    "flattened_bucket": st.booleans(), "pause_generation": st.booleans(),
    "continue_generation": st.booleans(),
}).map(lambda d: {"timeout_s": 0.2, **d})  # never the 120 s default wait for an absent master


# Valid requests with one field replaced by an adversarial value (or dropped): these get past the
# first checks, so the fuzz reaches the sampler and the model, not only the validators.
valid_sampling = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 6)}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(1, 50) | st.just(-1),
    "min_new_tokens": st.integers(0, 3), "stop_token_ids": st.lists(st.integers(0, 60), max_size=2),
    "sampling_seed": st.integers(0, 2**31), "ignore_eos": st.booleans(), "stop": st.lists(texts, max_size=2)})
valid_bodies = {
    "/generate": st.fixed_dictionaries(
        {"input_ids": good_ids, "sampling_params": valid_sampling},
        optional={"return_logprob": st.booleans(), "rid": st.text(max_size=8)}),
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": good_ids | st.text(min_size=1, max_size=20), "max_tokens": st.integers(0, 6)},
        optional={"temperature": st.floats(0, 2), "n": st.integers(1, 2), "logprobs": st.integers(0, 2),
                  "top_p": st.floats(0.1, 1)}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": texts}),
                              min_size=1, max_size=2),
         "max_tokens": st.integers(0, 6)},
        optional={"temperature": st.floats(0, 2), "n": st.integers(1, 2), "logprobs": st.booleans()}),
}
adversarial = scalars | json_values | st.sampled_from([2**100, -(2**100), 10**6, -1, 0, [], {}, "", [[]]])
_DROP = object()


def mutate(body: dict, where: int, value) -> dict:
    """Replace (or drop) one top-level or sampling_params field of ``body``."""
    body = json.loads(json.dumps(body))
    target = body
    if "sampling_params" in body and where % 2:
        target = body["sampling_params"]
    keys = sorted(target) + ["n", "max_new_tokens", "logprobs", "stream", "stop_token_ids"]
    key = keys[where % len(keys)]
    if value is _DROP:
        target.pop(key, None)
    else:
        target[key] = value
    return body


def mutated(path: str) -> st.SearchStrategy:
    return st.builds(mutate, valid_bodies[path], st.integers(0, 50), adversarial | st.just(_DROP))


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def as_bytes(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass")


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"null", b"[]", b"123", b'"x"', b"\xff\xfe", b'{"input_ids": [1,}',
                     deep(100_000).encode(), ('{"a":' * 50_000 + "1" + "}" * 50_000).encode(),
                     b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
                     b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1e400}}']),
    json_values.map(as_bytes),
)


def request_for(path: str) -> st.SearchStrategy:
    bodies = {"/generate": generate_bodies, "/v1/completions": completion_bodies,
              "/v1/chat/completions": chat_bodies}.get(path, admin_bodies)
    if path in valid_bodies:
        bodies = st.one_of(bodies, mutated(path), mutated(path), valid_bodies[path])
    return st.tuples(st.just(path), st.one_of(bodies.map(as_bytes), raw_bodies))


requests_ = st.sampled_from(GENERATION + ADMIN).flatmap(request_for)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()


def _check(resp: httpx.Response, path: str, body: bytes) -> None:
    where = f"POST {path} {body[:300]!r}"
    assert resp.status_code < 500, f"{where} -> {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        msg = resp.json()
        text = msg.get("message") or (msg.get("error") or {}).get("message") or msg.get("detail")
        assert text, f"{where} -> {resp.status_code} without a message: {resp.text[:300]}"
    elif path == "/generate":  # an engine failure must not hide inside a 200 as an "abort"
        out = resp.json()
        for o in out if isinstance(out, list) else [out]:
            fin = o["meta_info"]["finish_reason"] or {}
            assert "engine error" not in str(fin.get("message", "")), f"{where} -> 200 with {fin}"


def _req(path: str, body) -> tuple[str, bytes]:
    return path, body if isinstance(body, bytes) else as_bytes(body)


# Cases the fuzz found, kept as fixed examples (each broke the server before its fix).
FOUND = [
    _req("/update_weight_version", deep(100_000).encode()),  # RecursionError in json.loads: 500
    _req("/generate", ('{"a":' * 50_000 + "1" + "}" * 50_000).encode()),  # connection reset
    _req("/init_weights_update_group", {"master_address": "", "master_port": 0, "rank_offset": 0,
                                        "world_size": 0, "group_name": "", "timeout_s": 0.2}),  # 500
    _req("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "n": 10**6}),  # wedged the server
    _req("/generate", {"input_ids": [[1]] * 5000, "sampling_params": {"max_new_tokens": 1}}),
    _req("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 1e-40}}),
    _req("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}'),
    _req("/update_weight_version", {"new_version": 2**70}),
]


def test_fuzzed_requests_never_get_a_5xx(server):
    client = httpx.Client(base_url=f"http://{server.address}", timeout=60.0)
    seen = {"n": 0, "generated": 0}

    @settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests_)
    def one(req):
        path, body = req
        seen["n"] += 1
        try:
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
            _check(resp, path, body)
            seen["generated"] += path in GENERATION and resp.status_code == 200
        finally:  # a fuzzed pause or group join must not leak into the next example
            client.post("/continue_generation", json={})
            client.post("/destroy_weights_update_group", json={})

    for case in FOUND:
        one = example(case)(one)
    try:
        one()
    finally:
        client.close()
    assert seen["n"] >= N_EXAMPLES
    print(f"hf server fuzz: {seen['n']} requests, {seen['generated']} answered by generating")
    assert seen["generated"] >= N_EXAMPLES // 50  # the fuzz reaches the model, not only the validators
    assert server.alive()
    log = open(server.log_path, errors="replace").read()
    assert "engine step failed" not in log and "Traceback" not in log, log[-3000:]
    r = httpx.post(f"http://{server.address}/generate", timeout=60.0,
                   json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1
