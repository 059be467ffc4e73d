"""Validation of a vision-language model (``model.vision.depth`` > 0) against the plan's engines, and of
``model.freeze_vision_tower`` (import-light: no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_cli.config.model import is_vision_language
from areal_cli.engines import engines_with, get_engine_spec
from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


def check_vision(cfg: ExperimentConfig, plan: Any) -> None:
    vl = is_vision_language(cfg.model)
    if cfg.model.freeze_vision_tower and not vl:
        raise ConfigError("model.freeze_vision_tower", f"is true, but model {cfg.model.name!r} has no vision tower "
                          "(model.vision.depth=0)", "set model.freeze_vision_tower=false, or use a vision-language "
                          "model (model=tiny_vl)")
    if not vl:
        return
    capable = engines_with("vision")
    for t in plan.trains:
        dims = get_engine_spec(t.backend).vision
        if not dims:
            raise ConfigError("engine.name", f"{t.backend} does not train vision-language models ({cfg.model.name} "
                              "has a vision tower; its model code takes no images)",
                              f"use engine.name={' or '.join(capable)}")
        p = t.parallel
        sizes = {"d": p.dp, "t": p.tp, "p": p.pp, "c": p.cp, "e": p.ep}
        cut = [x for x in "tpce" if sizes[x] > 1 and x not in dims]
        if cut:
            x = cut[0]
            others = [n for n in capable if x in get_engine_spec(n).vision]
            alt = f", or use engine.name={' or '.join(others)}" if others else ""
            raise ConfigError("allocation_mode", f"{t.backend} trains a vision-language model under "
                              f"{', '.join(dims)} only (this plan has {x}{sizes[x]})",
                              f"drop {x} from the {t.backend} dims{alt}")


def check_visual_servers(cfg: Any, plan: Any) -> None:
    """Visual data (a built-in visual task, a dataset with an image column) needs servers that carry images."""
    from areal_cli.data.checks import dataset_paths, visual_source
    from areal_cli.inference.backends import imageless_backends

    other = imageless_backends(p.backend for p in plan.inferences)
    if not other:
        return
    for key, path in dataset_paths(cfg.dataset):
        what = visual_source(cfg.dataset, key, path)
        if what is not None:
            raise ConfigError("allocation_mode", f"{path} is {what}, and {', '.join(other)} servers do not carry "
                              "images to the trainer (docs/vision.md)",
                              "use hf, sglang or vllm inference servers (allocation_mode=hf:d1+fsdp:d1)")
