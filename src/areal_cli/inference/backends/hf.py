"""The built-in ``hf`` server speaks SGLang's protocol; it adds per-token weight versions
(``meta_info.output_token_weight_versions``), which :func:`parse_generate` already prefers."""

from __future__ import annotations

from areal_cli.inference.backends.sglang import (HEALTH, build_continue, build_generate, build_get_version,
                                                 build_init_group, build_pause, build_set_version,
                                                 build_update_distributed, build_update_from_disk, check_ok,
                                                 parse_generate, parse_version, sampling_params)

NAME = "hf"

__all__ = ["HEALTH", "NAME", "build_continue", "build_generate", "build_get_version", "build_init_group",
           "build_pause", "build_set_version", "build_update_distributed", "build_update_from_disk", "check_ok",
           "parse_generate", "parse_version", "sampling_params"]
