"""The built-in ``hf`` server speaks SGLang's protocol; it adds per-token weight versions
(``meta_info.output_token_weight_versions``), which :func:`parse_generate` already prefers, and the
optional ``flattened_bucket`` field of ``/update_weights_from_distributed`` (one broadcast per dtype
of the bucket's tensors concatenated in request order, instead of one per tensor), and its optional
``pause_generation`` / ``continue_generation`` fields: the server pauses (aborting running requests)
right before applying the bucket and continues right after, at one token boundary, so a one-bucket
push needs no separate pause/continue round trips."""

from __future__ import annotations

from areal_cli.inference.backends.sglang import (HEALTH, build_continue, build_generate, build_generate_batch,
                                                 build_get_version, build_init_group, build_pause,
                                                 build_set_version, build_update_from_disk, check_ok,
                                                 parse_generate, parse_generate_batch, parse_version,
                                                 sampling_params)
from areal_cli.inference.backends.sglang import build_update_distributed as _sglang_update_distributed

NAME = "hf"
SUPPORTS_FLATTENED_BUCKET = True
SUPPORTS_ATOMIC_UPDATE = True


def build_update_distributed(meta, specs, *, flush_cache: bool = True, flattened_bucket: bool = False,
                             pause_generation: bool = False, continue_generation: bool = False):
    """SGLang's request; ``flattened_bucket`` / ``pause_generation`` / ``continue_generation`` add the
    hf-only fields (never sent to SGLang)."""
    call = _sglang_update_distributed(meta, specs, flush_cache=flush_cache)
    if flattened_bucket:
        call.json["flattened_bucket"] = True
    if pause_generation:
        call.json["pause_generation"] = True
    if continue_generation:
        call.json["continue_generation"] = True
    return call


__all__ = ["HEALTH", "NAME", "SUPPORTS_ATOMIC_UPDATE", "SUPPORTS_FLATTENED_BUCKET", "build_continue", "build_generate", "build_generate_batch", "build_get_version",
           "build_init_group", "build_pause", "build_set_version", "build_update_distributed", "build_update_from_disk", "check_ok",
           "parse_generate", "parse_generate_batch", "parse_version", "sampling_params"]
