"""The built-in ``hf`` server speaks SGLang's protocol (the same builders, the same begin/end weight-update
session, ``load_format="flattened_bucket"``, the version in ``/model_info``). It adds per-token weight
versions (``meta_info.output_token_weight_versions``), which :func:`parse_generate` already prefers,
and the optional ``pause_generation`` / ``continue_generation`` fields of
``/update_weights_from_distributed``: the server pauses (aborting running requests) right before
applying the bucket and continues right after, at one token boundary, so a push needs no separate
pause/continue round trips."""

from __future__ import annotations

from areal_cli.inference.backends.sglang import (HEALTH, build_begin_update, build_continue, build_end_update,
                                                 build_generate, build_generate_batch, build_get_version,
                                                 build_init_group, build_pause, build_release_memory,
                                                 build_resume_memory, build_set_version, build_update_from_disk,
                                                 check_ok, group_ranks, parse_generate, parse_generate_batch,
                                                 parse_version, sampling_params)
from areal_cli.inference.backends.sglang import build_update_distributed as _sglang_update_distributed

NAME = "hf"
SUPPORTS_FLATTENED_BUCKET = True
SUPPORTS_ATOMIC_UPDATE = True
SERVER_ENV: dict[str, str] = {}


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


__all__ = ["HEALTH", "NAME", "SERVER_ENV", "SUPPORTS_ATOMIC_UPDATE", "SUPPORTS_FLATTENED_BUCKET", "build_begin_update",
           "build_continue", "build_end_update", "build_generate", "build_generate_batch", "build_get_version",
           "build_init_group", "build_pause", "build_release_memory", "build_resume_memory", "build_set_version",
           "build_update_distributed", "build_update_from_disk", "check_ok", "group_ranks", "parse_generate",
           "parse_generate_batch", "parse_version", "sampling_params"]
