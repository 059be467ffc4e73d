"""Helpers shared by command modules: override arguments, JSON output, error wrapping."""

from __future__ import annotations

import json
import sys
from typing import Any

OVERRIDES_HELP = ("Hydra overrides: group=option (algo=dapo), key.path=value (rollout.group_size=8), "
                  "allocation_mode=<preset or spec>")


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def error_json(exc: BaseException) -> dict:
    to_dict = getattr(exc, "to_dict", None)
    return {"valid": False, "error": to_dict() if callable(to_dict) else {"reason": str(exc)},
            "message": str(exc)}


def check_vision_servers(cfg: Any) -> None:
    """``areal train`` of a vision-language model, before its download: the engine must train images (an engine
    spec's ``vision``) and the servers carry them (a backend spec's ``images``: hf, sglang and vllm do;
    docs/vision.md)."""
    from areal_cli.allocation.parser import parse_allocation
    from areal_cli.engines import engines_with, get_engine_spec
    from areal_cli.errors import ConfigError
    from areal_cli.inference.backends import imageless_backends

    if not get_engine_spec(cfg.engine.name).vision:
        raise ConfigError("engine.name", f"{cfg.engine.name} does not train vision-language models "
                          f"({cfg.model.name} has a vision tower; docs/vision.md)",
                          f"use engine.name={' or '.join(engines_with('vision'))}")

    other = imageless_backends(c.backend for c in parse_allocation(str(cfg.allocation_mode.spec)).inference)
    if other:
        raise ConfigError("model.vision", f"{cfg.model.name} is a vision-language model, and {', '.join(other)} "
                          "servers do not carry images to the trainer (docs/vision.md)",
                          "use hf, sglang or vllm inference servers (allocation_mode=hf:d1+fsdp:d1, or "
                          "sglang:d4+fsdp:d4 on GPUs); `areal validate-config` and `areal train --dry-run` still "
                          "plan this one")


def compose_and_validate(overrides: list[str], as_json: bool = False, *, fetch_model: bool = False):
    """``(cfg, plan)`` for ``overrides``; raises ConfigError on any mistake (after printing it as the JSON
    error object when ``as_json``, for tools that parse ``--json``). ``fetch_model`` (``areal train``): a hub
    model the CLI fetches itself is downloaded first, so validation checks its real config.json."""
    from areal_cli.errors import ArealError, ConfigError
    from areal_cli.plan.compose import explain_range, load_config, prepare
    from areal_cli.plan.recipe import toy_value_warnings
    from areal_cli.plan.validate import validate

    prep = None
    try:
        prep = prepare(list(overrides))
        cfg = load_config(prepared=prep)
        if fetch_model:
            from areal_cli.cli.launch import fetch_hub_model
            from areal_cli.config.model import is_vision_language

            if is_vision_language(cfg.model):  # before a download: nothing could run the model it fetched
                check_vision_servers(cfg)

            if fetch_hub_model(cfg):  # the snapshot's config.json now supplies the facts, and the recipe
                prep = prepare(list(overrides))
                cfg = load_config(prepared=prep)
        plan = validate(cfg)
        if prep.recipe_note:
            plan.notes.append(prep.recipe_note)
        plan.warnings.extend(toy_value_warnings(cfg, prep.explicit_keys))
        return cfg, plan
    except ArealError as exc:
        err = explain_range(exc, prep) if prep is not None and isinstance(exc, ConfigError) else exc
        if as_json:
            print_json(error_json(err))
        if err is exc:
            raise
        raise err from None
