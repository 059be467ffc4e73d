"""Request parsing for the ``hf`` server: SGLang's and OpenAI's JSON shapes, with 400s that say why."""

from __future__ import annotations

from typing import Any

from areal_cli.inference.server.sampling import SamplingParams


class BadRequest(ValueError):
    """Rendered as HTTP 400 with ``{"error": {"message": ...}}``."""


_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,), "min_new_tokens": (int,), "temperature": (int, float),
    "top_p": (int, float), "top_k": (int,), "stop": (str, list), "stop_token_ids": (list,),
    "ignore_eos": (bool,), "skip_special_tokens": (bool,), "sampling_seed": (int,),
}
# The smallest non-zero temperature: below it logits / T overflows float32 to inf and the step's
# sampling fails for every sequence in the batch (found by the HTTP fuzz test). 0 is greedy.
MIN_TEMPERATURE = 1e-5
# Accepted for compatibility with SGLang clients when left at their neutral value.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
            "n": 1, "no_stop_trim": False, "spaces_between_special_tokens": True}


def _typed(name: str, value: Any, types: tuple[type, ...]) -> Any:
    if isinstance(value, bool) and bool not in types:
        raise BadRequest(f"{name} must be {' or '.join(t.__name__ for t in types)}, got a boolean")
    if not isinstance(value, types):
        raise BadRequest(f"{name} must be {' or '.join(t.__name__ for t in types)}, "
                         f"got {type(value).__name__} {value!r}")
    return value


def parse_sampling(sp: Any, *, default_max_new_tokens: int = 128) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    out = SamplingParams(max_new_tokens=default_max_new_tokens)
    for k, v in sp.items():
        if v is None:
            continue
        if k in _NEUTRAL:
            if v != _NEUTRAL[k]:
                raise BadRequest(f"sampling_params.{k}={v!r} is not supported by the hf server "
                                 f"(only {_NEUTRAL[k]!r})")
            continue
        if k not in _SAMPLING_FIELDS:
            raise BadRequest(f"unknown sampling_params field {k!r}; known: {sorted(_SAMPLING_FIELDS)}")
        _typed(f"sampling_params.{k}", v, _SAMPLING_FIELDS[k])
        if k == "stop":
            v = [v] if isinstance(v, str) else v
            if not all(isinstance(x, str) for x in v):
                raise BadRequest("sampling_params.stop must be a string or a list of strings")
        if k == "stop_token_ids" and not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
        setattr(out, k, v)
    if out.max_new_tokens < 0 or out.min_new_tokens < 0:
        raise BadRequest("max_new_tokens and min_new_tokens must be >= 0")
    if out.temperature < 0 or 0 < out.temperature < MIN_TEMPERATURE:
        raise BadRequest(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {out.temperature}")
    if not 0.0 < out.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {out.top_p}")
    if out.top_k < -1:
        raise BadRequest(f"top_k must be -1 (disabled) or >= 1, got {out.top_k}")
    out.temperature = float(out.temperature)
    out.top_p = float(out.top_p)
    return out


def parse_token_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{name} must be a non-empty list of token ids")
    for x in ids:
        if not isinstance(x, int) or isinstance(x, bool):
            raise BadRequest(f"{name} must contain only integers, found {type(x).__name__} {x!r}")
        if not 0 <= x < vocab_size:
            raise BadRequest(f"{name} contains token id {x} outside the vocabulary [0, {vocab_size})")
    return ids


def check_context(n_prompt: int, max_new_tokens: int, context_length: int) -> None:
    if n_prompt >= context_length:
        raise BadRequest(f"prompt has {n_prompt} tokens but the context length is {context_length}")
    if n_prompt + max_new_tokens > context_length:
        raise BadRequest(f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"context length {context_length}; lower max_new_tokens to "
                         f"{context_length - n_prompt} or less")


def openai_sampling(body: dict, *, max_tokens_key: tuple[str, ...]) -> SamplingParams:
    """Map OpenAI completion fields onto :class:`SamplingParams`."""
    sp: dict[str, Any] = {}
    for key in max_tokens_key:
        if body.get(key) is not None:
            sp["max_new_tokens"] = body[key]
            break
    for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "min_tokens", "ignore_eos"):
        if body.get(k) is not None:
            sp["min_new_tokens" if k == "min_tokens" else k] = body[k]
    return parse_sampling(sp, default_max_new_tokens=16)


def bucket_request(body: dict) -> tuple[list, list, list, bool]:
    """``(names, dtypes, shapes, flattened)`` of a request that receives one bucket of tensors by broadcast.
    ``load_format="flattened_bucket"`` is SGLang's: the bucket travels as one uint8 tensor."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise BadRequest("names, dtypes and shapes (lists) are required")
    load_format = body.get("load_format")
    if load_format not in (None, "flattened_bucket"):
        raise BadRequest(f"load_format {load_format!r} is not supported; use 'flattened_bucket' or "
                         "leave it out")
    return names, dtypes, shapes, load_format == "flattened_bucket"


def group_problem(receiver: Any, body: dict) -> str | None:
    """Why a broadcast request cannot be received (no group joined, or another group named), else None."""
    if receiver is None:
        return "no weight-update group: call /init_weights_update_group first"
    gname = body.get("group_name")
    if gname is not None and gname != receiver.group_name:
        return f"group_name {gname!r} does not match the joined group {receiver.group_name!r}"
    return None
