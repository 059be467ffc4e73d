"""Validation of ``model.lora`` against the rest of the plan (import-light: no torch, no peft)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_cli.allocation.spec import DIM_NAMES
from areal_cli.config.model import lora_target_modules
from areal_cli.inference.push_mode import disk_only
from areal_cli.engines import engines_with, get_engine_spec
from areal_cli.errors import ConfigError
from areal_cli.inference.backends import backend_names, backend_spec

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


def check_lora(cfg: ExperimentConfig, plan: Any) -> None:
    lora = cfg.model.lora
    if int(lora.rank) <= 0:
        return
    lora_target_modules(lora.target_modules, moe=cfg.model.num_experts > 0)
    if cfg.algo.name == "sft":
        raise ConfigError("algo.name", "LoRA is wired into the RL loop (adapter sync into the servers); "
                          "algo=sft with an adapter is not", "fine-tune fully for SFT (model.lora.rank=0), or run RL "
                          "with LoRA (an SFT warm start, trainer.sft_warmup_steps, trains all weights)")
    # Each engine's spec says under which dims it applies peft adapters (engines/lora.py); "" refuses.
    for t in plan.trains:
        dims = get_engine_spec(t.backend).lora
        if not dims:
            capable = engines_with("lora")
            raise ConfigError("model.lora.rank", f"the {t.backend} engine does not train LoRA adapters "
                              f"(engines with LoRA: {', '.join(capable)})",
                              f"use engine={' or engine='.join(capable)}, or set model.lora.rank=0 "
                              "for full fine-tuning")
        p = t.parallel
        sizes = {"t": p.tp, "p": p.pp, "c": p.cp, "e": p.ep}
        cut = [x for x in "tpce" if sizes[x] > 1 and x not in dims]
        if cut:
            x = cut[0]
            raise ConfigError("model.lora.rank", f"{t.backend} with {DIM_NAMES[x]} parallelism ({x}{sizes[x]}) has "
                              f"no {x.upper()}P plan for adapter layers yet",
                              f"use {'/'.join(d for d in dims if d != 'e')} dims for LoRA with {t.backend} ({x}1), "
                              f"or engine={engines_with('lora')[0]}")
    others = sorted({p.backend for p in plan.inferences if disk_only(p.backend, lora=True)})
    if others and cfg.rollout.weight_update == "distributed":
        raise ConfigError("rollout.weight_update", f"{', '.join(others)} load LoRA adapters from a directory "
                          "(/load_lora_adapter), not from a broadcast",
                          "set rollout.weight_update=disk (an adapter is a few MB), or use the "
                          f"{' or '.join(n for n in backend_names() if backend_spec(n).lora_broadcast)} backend")
    if cfg.algo.use_critic:
        plan.warnings.append("model.lora: the critic trains all of its weights (the adapter is the "
                             "policy's only)")
