"""The built-in ``hf`` server speaks SGLang's protocol (the same builders, the same begin/end weight-update
session, ``load_format="flattened_bucket"``, the version in ``/model_info``). It adds per-token weight
versions (``meta_info.output_token_weight_versions``), which :func:`parse_generate` already prefers,
and the optional ``pause_generation`` / ``continue_generation`` fields of
``/update_weights_from_distributed``: the server pauses (aborting running requests) right before
applying the bucket and continues right after, at one token boundary, so a push needs no separate
pause/continue round trips.

LoRA (inference/server/lora.py): SGLang's ``/load_lora_adapter`` with the hf fields ``replace`` and
``weight_version`` (a new adapter version is one request, swapped at one token boundary), and the hf-only
``/load_lora_adapter_from_distributed`` (the adapter over the weight-update group)."""

from __future__ import annotations

import sys

from areal_cli.inference.backends.base import HttpCall, InferenceBackendSpec, ServerArgs
from areal_cli.inference.backends.sglang import (
    HEALTH,
    build_begin_update,
    build_continue,
    build_end_update,
    build_generate,
    build_generate_batch,
    build_get_version,
    build_init_group,
    build_pause,
    build_release_memory,
    build_resume_memory,
    build_set_version,
    build_unload_lora,
    build_update_from_disk,
    check_ok,
    group_ranks,
    is_transient_rejection,
    parse_generate,
    parse_generate_batch,
    parse_version,
    sampling_params,
)
from areal_cli.inference.backends.sglang import build_update_distributed as _sglang_update_distributed

NAME = "hf"
# Capabilities the client reads (the interface: backends/base.py).
SUPPORTS_BATCH_GENERATE = True
SUPPORTS_LORA_BROADCAST = True
SUPPORTS_FLATTENED_BUCKET = True
SUPPORTS_ATOMIC_UPDATE = True
NEEDS_MODEL_NAME = False
ONE_PAD_PER_IMAGE = False  # images go with the prompt's expanded pads as they are
SERVER_ENV: dict[str, str] = {}
# The cap rollout.max_concurrent_rollouts=auto keeps to when every server is hf (allocation/autosize.py).
MAX_CONCURRENCY = 64


def server_cmd(a: ServerArgs) -> tuple[list[str], dict[str, str]]:
    argv = [a.python or sys.executable, "-m", "areal_cli.inference.hf_server", "--model-path", a.model_path,
            "--host", a.host, "--port", str(a.port), "--dtype", a.dtype, "--device", a.device,
            "--tp-size", str(a.tp), "--random-seed", str(a.seed)]
    if a.context_length:
        argv += ["--context-length", str(a.context_length)]
    if a.lora_rank > 0:
        argv += ["--max-lora-rank", str(a.lora_rank)]
    return argv, {}


SPEC = InferenceBackendSpec(
    NAME, __name__, server_cmd, dims="d",
    dims_hint="the built-in hf server runs one process per instance: use only d, e.g. hf:d2",
    summary="the built-in server (SGLang's protocol; CPU and CUDA)",
    mem_fraction=1.0, reserves_memory=False,  # allocates on demand
    lora_broadcast=SUPPORTS_LORA_BROADCAST, batch_generate=SUPPORTS_BATCH_GENERATE,
    sampling_mask=True, routed_experts=True, images=True, max_concurrency=MAX_CONCURRENCY)


def build_server_info() -> None:
    """No version range to check: the server ships with this package."""
    return


def build_update_distributed(meta, specs, *, flush_cache: bool = True, flattened_bucket: bool = False,
                             pause_generation: bool = False, continue_generation: bool = False):
    """SGLang's request; ``pause_generation`` / ``continue_generation`` add the hf-only fields (never
    sent to SGLang)."""
    call = _sglang_update_distributed(meta, specs, flush_cache=flush_cache, flattened_bucket=flattened_bucket)
    if pause_generation:
        call.json["pause_generation"] = True
    if continue_generation:
        call.json["continue_generation"] = True
    return call


def build_load_lora(name: str, path: str, version: int, *, loaded: bool) -> list[HttpCall]:
    """``loaded`` is not needed: ``replace`` swaps an adapter already loaded under ``name``."""
    return [HttpCall("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path, "replace": True,
                                                    "weight_version": str(version)})]


def build_load_lora_distributed(meta, name: str, config: dict, specs) -> HttpCall:
    return HttpCall("POST", "/load_lora_adapter_from_distributed", {
        "lora_name": name, "config_dict": config, "names": [s.name for s in specs],
        "dtypes": [s.dtype for s in specs], "shapes": [list(s.shape) for s in specs],
        "group_name": meta.group_name, "load_format": "flattened_bucket", "replace": True,
        "weight_version": str(meta.version)})


__all__ = [
    "HEALTH",
    "NAME",
    "NEEDS_MODEL_NAME",
    "ONE_PAD_PER_IMAGE",
    "SERVER_ENV",
    "SPEC",
    "SUPPORTS_ATOMIC_UPDATE",
    "SUPPORTS_BATCH_GENERATE",
    "SUPPORTS_FLATTENED_BUCKET",
    "SUPPORTS_LORA_BROADCAST",
    "build_begin_update",
    "build_continue",
    "build_end_update",
    "build_generate",
    "build_generate_batch",
    "build_get_version",
    "build_init_group",
    "build_load_lora",
    "build_load_lora_distributed",
    "build_pause",
    "build_release_memory",
    "build_resume_memory",
    "build_server_info",
    "build_set_version",
    "build_unload_lora",
    "build_update_distributed",
    "build_update_from_disk",
    "check_ok",
    "group_ranks",
    "is_transient_rejection",
    "parse_generate",
    "parse_generate_batch",
    "parse_version",
    "sampling_params",
]
