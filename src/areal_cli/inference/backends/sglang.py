"""SGLang's native HTTP protocol: ``/generate``, pause/continue and the weight-update session.

Checked against sglang 0.5.23 by the contract tests, which send every payload built here through
SGLang's own routes and request models (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``; tests/integration/inference/test_sglang_contract.py). Supported servers:
``SUPPORTED_VERSIONS`` (read from ``GET /server_info``).

- ``/generate``: ``GenerateReqInput`` (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``);
  SGLang rejects unknown sampling keys and ``min_new_tokens > max_new_tokens`` with a 400.
- A distributed push is a session: ``/pause_generation`` → ``/begin_weight_update`` →
  (first time) ``/init_weights_update_group`` → ``/update_weights_from_distributed`` per bucket →
  ``/end_weight_update`` → ``/continue_generation``. Without the session SGLang answers updates
  with ``success=false`` (HTTP 400).
- Group ranks: every TP rank of a server joins the group at ``rank_offset + tp_rank``; the trainer is
  rank 0, server ``i`` gets ``rank_offset = 1 + sum(tp of servers before i)``, and the world size
  is ``1 + sum(tp)``.
- ``load_format="flattened_bucket"``: the bucket's tensors travel as one uint8 broadcast, their bytes
  concatenated in request order (each tensor at an offset aligned to its dtype's size).
- The weight version is ``weight_version`` in ``GET /model_info``.
- Images (``image_data``): an image prompt goes out with one ``<|image_pad|>`` per image
  (``base.one_pad_per_image``; docs/vision.md, "SGLang for visual runs"). SGLang 0.5.23
  (``SGLANG_MM_AVOID_RETOKENIZE``, on by default) keeps an ``input_ids`` prompt's own tokens and replaces *each*
  pad token by its image's count (``BaseMultimodalProcessor._expand_input_ids``, which requires as many pad
  tokens as images); a run of an image's exact count fails that check, and SGLang then re-tokenizes the decoded
  prompt through the HF processor, which expands every pad of the run again
  (``srt/multimodal/processors/base_processor.py``, ``qwen_vl.py``).
- LoRA: ``/load_lora_adapter`` (``LoadLoRAAdapterReqInput``: ``lora_name``, ``lora_path``),
  ``/unload_lora_adapter`` (``lora_name``), and ``/generate``'s ``lora_path`` naming the adapter per
  request. SGLang refuses a second load under a loaded name, so a new adapter version is pause →
  unload → load → ``/update_weight_version`` → continue (the server needs ``--enable-lora``).
"""

from __future__ import annotations

import sys
from typing import Any

from areal_cli.api.io_struct import GenerationConfig, ParamSpec, WeightUpdateMeta
from areal_cli.errors import InferenceError
from areal_cli.inference.backends.base import (
    HttpCall,
    InferenceBackendSpec,
    PackageNeed,
    Segment,
    ServerArgs,
    one_pad_per_image,
    version_from,
)

NAME = "sglang"
HEALTH = HttpCall("GET", "/health")
# Capabilities the client reads (the interface: backends/base.py).
SUPPORTS_BATCH_GENERATE = True  # /generate takes a list of prompts
SUPPORTS_FLATTENED_BUCKET = True
SUPPORTS_ATOMIC_UPDATE = False
SUPPORTS_LORA_BROADCAST = False  # adapters load from a directory
NEEDS_MODEL_NAME = False  # /generate serves the one loaded model
# An image prompt goes out with one <|image_pad|> per image (build_generate's image_pad_id), which SGLang expands
ONE_PAD_PER_IMAGE = True
# Inclusive lower bound, exclusive upper bound. The lower bound is the release the contract tests run
# (begin/end_weight_update, weight_version in /model_info); the upper one the next minor series.
SUPPORTED_VERSIONS = ((0, 5, 23), (0, 6, 0))
SERVER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}  # /health must not queue behind a pause


def server_cmd(a: ServerArgs) -> tuple[list[str], dict[str, str]]:
    argv = [a.python or sys.executable, "-m", "sglang.launch_server", "--model-path", a.model_path,
            "--host", a.host, "--port", str(a.port), "--tp-size", str(a.tp), "--pp-size", str(a.pp),
            "--dtype", a.dtype, "--random-seed", str(a.seed), "--device", a.device, "--skip-server-warmup"]
    if a.context_length:
        argv += ["--context-length", str(a.context_length)]
    if a.lora_rank > 0:  # adapters come later through /load_lora_adapter, so declare their shape now
        argv += ["--enable-lora", "--max-lora-rank", str(a.lora_rank), "--lora-target-modules", *a.lora_targets]
    # SGLang's /health generates a token by default, which waits while a weight push holds generation
    # paused; the client's 5 s probe would then drop paused servers from routing.
    return argv, dict(SERVER_ENV)


SPEC = InferenceBackendSpec(
    NAME, __name__, server_cmd, dims="dtpe", summary="SGLang (GPU nodes)",
    mem_fraction=0.88,  # mem_fraction_static's default
    lora_broadcast=SUPPORTS_LORA_BROADCAST, batch_generate=SUPPORTS_BATCH_GENERATE, gpu_only=True,
    cpu_note="sglang needs GPUs",
    package=PackageNeed("sglang", "sglang", "pip install 'areal-cli[sglang]' (or AREAL_EXTRAS=sglang "
                        "bash scripts/install.sh)"), images=True)


def sampling_params(g: GenerationConfig, max_new_tokens: int | None = None) -> dict[str, Any]:
    budget = g.max_new_tokens if max_new_tokens is None else max_new_tokens
    sp: dict[str, Any] = {
        "max_new_tokens": budget,
        # SGLang answers min_new_tokens > max_new_tokens with a 400; a resumed request can get there.
        "min_new_tokens": min(g.min_new_tokens, budget),
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": 1.0 if g.greedy else g.top_p,
        "top_k": 1 if g.greedy else (g.top_k if g.top_k and g.top_k > 0 else -1),
    }
    if g.stop:
        sp["stop"] = list(g.stop)
    if g.stop_token_ids:
        sp["stop_token_ids"] = list(g.stop_token_ids)
    if g.seed is not None and not g.greedy:
        sp["sampling_seed"] = int(g.seed)
    return sp


def build_generate(input_ids: list[int], g: GenerationConfig, *, max_new_tokens: int | None = None,
                   rid: str | None = None, lora: str | None = None, image_data: list[str] | None = None,
                   image_pad_id: int | None = None) -> HttpCall:
    """``image_data``: SGLang's field, the prompt's images in order (data URLs, base64 or server paths);
    ``image_pad_id``: the placeholder's id, each run of which goes out as one pad (``base.one_pad_per_image``).
    SGLang reports no expanded prompt, so the response's ``input_tokens`` stay the expanded ids the caller sent,
    which are SGLang's own expansion of the one-pad prompt."""
    if image_data:
        input_ids = one_pad_per_image(input_ids, image_pad_id, len(image_data), "SGLang")
    body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_params(g, max_new_tokens),
                            "return_logprob": True, "stream": False}
    if image_data:
        body["image_data"] = list(image_data)
    if g.keep_sampling_mask:  # an hf-server field; the config refuses it with other backends
        body["return_sampling_mask"] = True
    if g.return_routed_experts:  # SGLang's (server flag --enable-return-routed-experts) and the hf server's
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = rid
    if lora is not None:
        body["lora_path"] = lora  # SGLang's field holds the adapter *name* of a loaded adapter
    return HttpCall("POST", "/generate", body)


def build_generate_batch(inputs: list[list[int]], gs: list[GenerationConfig],
                         max_new_tokens: list[int], lora: str | None = None,
                         image_data: list[list[str] | None] | None = None,
                         image_pad_id: int | None = None) -> HttpCall:
    """SGLang's batch form of ``/generate``: ``input_ids`` a list of prompts and ``sampling_params`` a
    list with one object per prompt; the response is a list of per-prompt answers, in order.
    ``image_data``: one list of images per prompt; sent as a list of lists (``[]`` for a prompt without
    images: SGLang reads a first entry that is not a list as one image per prompt); ``image_pad_id``: as for
    :func:`build_generate`."""
    if image_data:
        inputs = [one_pad_per_image(x, image_pad_id, len(im), "SGLang") if im else x
                  for x, im in zip(inputs, image_data)]
    body: dict[str, Any] = {"input_ids": [list(x) for x in inputs],
                            "sampling_params": [sampling_params(g, m) for g, m in zip(gs, max_new_tokens)],
                            "return_logprob": True, "stream": False}
    if image_data and any(image_data):
        body["image_data"] = [list(x or []) for x in image_data]
    if any(g.keep_sampling_mask for g in gs):
        body["return_sampling_mask"] = True
    if any(g.return_routed_experts for g in gs):
        body["return_routed_experts"] = True
    if lora is not None:
        body["lora_path"] = lora
    return HttpCall("POST", "/generate", body)


def parse_generate_batch(resp: Any, n: int, *, fallback_version: int = 0) -> list[Segment]:
    if not isinstance(resp, list) or len(resp) != n:
        raise InferenceError(f"malformed SGLang batch /generate response: expected a list of {n} answers, "
                             f"got {str(resp)[:300]}")
    return [parse_generate(r, fallback_version=fallback_version) for r in resp]


def parse_generate(resp: dict[str, Any], *, fallback_version: int = 0) -> Segment:
    try:
        meta = resp["meta_info"]
        lps = meta.get("output_token_logprobs") or []
        tokens = [int(x[1]) for x in lps] if lps else [int(t) for t in resp.get("output_ids", [])]
        logprobs = [float(x[0]) for x in lps]
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise InferenceError(f"malformed SGLang /generate response ({e}): {str(resp)[:300]}") from None
    if kind == "error":  # the hf server's engine failed this request: resubmitting would fail again
        raise InferenceError(f"the server failed the request: {fr.get('message') if isinstance(fr, dict) else fr}")
    if kind not in ("stop", "length", "abort"):
        raise InferenceError(f"unexpected finish_reason {fr!r} in SGLang response")
    if len(logprobs) != len(tokens):
        raise InferenceError("SGLang response has no output_token_logprobs; send return_logprob=true")
    version = version_from(meta.get("weight_version"))
    per_tok = meta.get("output_token_weight_versions")  # hf-server extension
    if isinstance(per_tok, list) and len(per_tok) == len(tokens):
        versions = [int(v) for v in per_tok]
    else:
        versions = [fallback_version if version is None else version] * len(tokens)
    seg = Segment(tokens, logprobs, versions, kind, version)
    cuts, mlps = meta.get("output_token_sampling_cutoffs"), meta.get("output_token_sampling_logprobs")
    if cuts is not None or mlps is not None:
        if not (isinstance(cuts, list) and isinstance(mlps, list) and len(cuts) == len(mlps) == len(tokens)):
            raise InferenceError(f"malformed sampling mask in /generate response: {str(meta)[:300]}")
        try:
            seg.sampling_cutoffs = [float("-inf") if c is None else float(c) for c in cuts]
            seg.sampling_logprobs = [float(x) for x in mlps]
        except (TypeError, ValueError) as e:
            raise InferenceError(f"malformed sampling mask in /generate response ({e})") from None
    if meta.get("routed_experts") is not None:
        seg.routed_experts = _routed_experts(meta)
    prompt = meta.get("prompt_token_ids")  # hf-server extension, sent for prompts with images
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        seg.prompt_ids = prompt
    return seg


def _routed_experts(meta: dict[str, Any]) -> Any:
    """SGLang's ``meta_info.routed_experts`` (base64 int32, ``[prompt + completion - 1, layers, k]``)."""
    from areal_cli.engines.routing_replay import decode

    try:
        n = max(0, int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1)
        return decode(meta["routed_experts"], n)
    except (KeyError, TypeError, ValueError) as e:
        raise InferenceError(f"malformed routed_experts in /generate response ({e})") from None


def build_pause() -> HttpCall:
    return HttpCall("POST", "/pause_generation", {"mode": "abort"})


def build_continue() -> HttpCall:
    return HttpCall("POST", "/continue_generation", {})


def build_update_from_disk(meta: WeightUpdateMeta) -> HttpCall:
    if not meta.path:
        raise InferenceError("WeightUpdateMeta.path is required for a disk weight update")
    return HttpCall("POST", "/update_weights_from_disk",
                    {"model_path": meta.path, "load_format": "safetensors", "abort_all_requests": False,
                     "weight_version": str(meta.version)})


def build_begin_update() -> HttpCall:
    return HttpCall("POST", "/begin_weight_update", {})


def build_end_update() -> HttpCall:
    return HttpCall("POST", "/end_weight_update", {})


def group_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """``(rank_offset per server, world size)`` of the weight-update group: trainer rank 0, then
    each server's TP ranks at ``rank_offset + tp_rank``."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


def build_init_group(meta: WeightUpdateMeta, rank_offset: int) -> HttpCall:
    return HttpCall("POST", "/init_weights_update_group", {
        "master_address": meta.master_address, "master_port": int(meta.master_port),
        "rank_offset": int(rank_offset), "world_size": int(meta.world_size),
        "group_name": meta.group_name, "backend": meta.backend})


def build_update_distributed(meta: WeightUpdateMeta, specs: list[ParamSpec], *, flush_cache: bool = True,
                             flattened_bucket: bool = False) -> HttpCall:
    body: dict[str, Any] = {
        "names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs], "group_name": meta.group_name,
        "flush_cache": flush_cache, "weight_version": str(meta.version)}
    if flattened_bucket:
        body["load_format"] = "flattened_bucket"
    return HttpCall("POST", "/update_weights_from_distributed", body)


def build_get_version() -> HttpCall:
    return HttpCall("GET", "/model_info")


def parse_version(resp: dict[str, Any]) -> int | None:
    return version_from(resp.get("weight_version"))


def build_server_info() -> HttpCall:
    return HttpCall("GET", "/server_info")


def check_server_version(resp: Any, address: str) -> str:
    """The server's SGLang version from ``/server_info``; raises if it is outside ``SUPPORTED_VERSIONS``."""
    lo, hi = SUPPORTED_VERSIONS
    want = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    raw = resp.get("version") if isinstance(resp, dict) else None
    try:
        got = tuple(int(x) for x in str(raw).split("+")[0].split(".")[:3])
    except ValueError:
        got = ()
    if len(got) != 3 or not (lo <= got < hi):
        raise InferenceError(f"SGLang server {address} reports version {raw!r}; areal-cli speaks the weight-update "
                             f"protocol of sglang {want} (begin/end_weight_update, weight_version in /model_info). "
                             f"Run a supported sglang, or use the hf/vllm backend")
    return str(raw)


def build_release_memory() -> HttpCall:
    """Free the server's GPU memory (weights and KV cache) for a colocated trainer; needs
    ``--enable-memory-saver``. Generation must be paused first."""
    return HttpCall("POST", "/release_memory_occupation", {})


def build_resume_memory() -> HttpCall:
    return HttpCall("POST", "/resume_memory_occupation", {})


def build_set_version(version: int) -> HttpCall:
    return HttpCall("POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})


def build_unload_lora(name: str) -> HttpCall:
    return HttpCall("POST", "/unload_lora_adapter", {"lora_name": name})


def build_load_lora(name: str, path: str, version: int, *, loaded: bool) -> list[HttpCall]:
    """A new adapter version under ``name``; ``loaded``: the server holds an older one (unloaded first)."""
    calls = [build_pause()] + ([build_unload_lora(name)] if loaded else [])
    return calls + [HttpCall("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}),
                    build_set_version(version), build_continue()]


def is_transient_rejection(status: int, body: str) -> bool:
    """No refusal here is transient: an error answer is the request's."""
    return False


def check_ok(resp: Any, what: str) -> None:
    """SGLang answers admin calls with ``{"success": bool, "message": str}``."""
    if isinstance(resp, dict) and resp.get("success") is False:
        raise InferenceError(f"{what} failed: {resp.get('message')}")
