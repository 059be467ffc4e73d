"""Shared shapes for the pure payload builders/parsers of each server backend.

A builder returns an :class:`HttpCall` (method, path, JSON body, query params); a parser turns a JSON
response into a :class:`Segment`. No I/O happens here, so contract tests can check every payload
against the servers' documented schemas without a server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from areal_cli.api.backend_spec import InferenceBackendSpec, PackageNeed, ServerArgs  # noqa: F401  (re-exported)


@dataclass
class HttpCall:
    method: Literal["GET", "POST"]
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Segment:
    """One server answer to one generation call (a resumed request has several)."""

    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]  # per token; filled from the segment version when the server has no per-token tags
    finish: Literal["stop", "length", "abort"]
    version: int | None  # the server's weight version at the end of the segment, if it reports one
    # Keep-Sampling-Mask (hf server, ``return_sampling_mask``): per token, the kept set's cutoff on
    # ``logits / T`` (-inf: nothing cut) and the logprob under the truncated distribution. None: not asked.
    sampling_cutoffs: list[float] | None = None
    sampling_logprobs: list[float] | None = None
    # Routing replay (``return_routed_experts``): int16 ``[prompt + completion - 1, n_layers * top_k]``
    # (engines/routing_replay.py). None: not asked.
    routed_experts: Any = None
    # The prompt as the model saw it, image pads expanded (the hf server's ``meta_info.prompt_token_ids``,
    # sent for requests with images). None: the server did not say (its prompt is the one sent).
    prompt_ids: list[int] | None = None


def version_from(value: Any) -> int | None:
    """SGLang reports versions as strings ("3"); non-integer tags (SGLang's "default") mean unknown."""
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# The interface inference/client.py calls on a backend module (hf, sglang, vllm). Every backend
# provides every member of INTERFACE, so the client never asks which backend it talks to: what differs
# is a declared capability (a SUPPORTS_*/NEEDS_* flag), or a builder that returns no calls (vLLM's
# begin/end update session) or no call (build_server_info: no version range to check).
INTERFACE = (
    "NAME", "HEALTH", "SUPPORTS_BATCH_GENERATE", "SUPPORTS_FLATTENED_BUCKET", "SUPPORTS_ATOMIC_UPDATE",
    "SUPPORTS_LORA_BROADCAST", "NEEDS_MODEL_NAME", "ONE_PAD_PER_IMAGE",
    "build_generate", "parse_generate", "is_transient_rejection", "check_ok",
    "build_pause", "build_continue", "build_update_from_disk", "build_begin_update", "build_end_update",
    "build_server_info", "group_ranks", "build_init_group", "build_update_distributed",
    "build_get_version", "parse_version", "build_load_lora",
)
# Members a backend provides only with the capability that makes the client call them.
CAPABILITY_MEMBERS = {
    "SUPPORTS_BATCH_GENERATE": ("build_generate_batch", "parse_generate_batch"),
    "NEEDS_MODEL_NAME": ("build_models", "parse_model_name"),
    "SUPPORTS_LORA_BROADCAST": ("build_load_lora_distributed",),
}



def one_pad_per_image(ids: list[int], pad_id: int | None, n_images: int, server: str) -> list[int]:
    """``ids`` with each maximal run of ``pad_id`` cut to one pad: the prompt form SGLang and vLLM expand
    themselves (backends declaring ``ONE_PAD_PER_IMAGE``), each pad to its image's token count.

    The trainer's rows hold the expanded ids (the HF processor's counts, models/vl_inputs.py); sent as they
    are, every pad of a run would be expanded again. ``pad_id`` ``None``: the prompt as it is."""
    if pad_id is None:
        return list(ids)
    out = [t for i, t in enumerate(ids) if t != pad_id or i == 0 or ids[i - 1] != pad_id]
    runs = out.count(pad_id)
    if runs != n_images:
        from areal_cli.errors import InferenceError

        raise InferenceError(f"an image prompt has {runs} image placeholder run(s) for {n_images} image(s); "
                             f"{server} needs one per image (a generated <|image_pad|> in a resumed prompt?)")
    return out
