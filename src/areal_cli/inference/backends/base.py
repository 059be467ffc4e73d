"""Shared shapes for the pure payload builders/parsers of each server backend.

A builder returns an :class:`HttpCall` (method, path, JSON body, query params); a parser turns a JSON
response into a :class:`Segment`. No I/O happens here, so contract tests can check every payload
against the servers' documented schemas without a server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


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


def version_from(value: Any) -> int | None:
    """SGLang reports versions as strings ("3"); non-integer tags (SGLang's "default") mean unknown."""
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
