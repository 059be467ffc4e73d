"""Validation of ``model.lora`` against the rest of the plan (import-light: no torch, no peft)."""

from __future__ import annotations

from typing import Any

from areal_cli.config.model import lora_target_modules
from areal_cli.config.rollout import LORA_DISK_ONLY_BACKENDS
from areal_cli.errors import ConfigError

# Training engines that apply peft adapters (engines/lora.py); the others refuse model.lora.rank > 0.
LORA_ENGINES = ("fsdp", "archon", "deepspeed")
# Servers that load adapters from an areal-written directory; the adapter travels by disk to these.


def check_lora(cfg: Any, plan: Any) -> None:
    lora = cfg.model.lora
    if int(lora.rank) <= 0:
        return
    lora_target_modules(lora.target_modules, moe=cfg.model.num_experts > 0)
    if cfg.algo.name == "sft":
        raise ConfigError("algo.name", "LoRA is wired into the RL loop (adapter sync into the servers); "
                          "algo=sft with an adapter is not", "fine-tune fully for SFT (model.lora.rank=0), or run RL "
                          "with LoRA (an SFT warm start, trainer.sft_warmup_steps, trains all weights)")
    for t in plan.trains:
        if t.backend not in LORA_ENGINES:
            raise ConfigError("model.lora.rank", f"the {t.backend} engine does not train LoRA adapters "
                              f"(engines with LoRA: {', '.join(LORA_ENGINES)})",
                              f"use engine={' or engine='.join(LORA_ENGINES)}, or set model.lora.rank=0 "
                              "for full fine-tuning")
        if t.backend == "archon" and t.parallel.tp > 1:
            raise ConfigError("model.lora.rank", f"archon with tensor parallelism (t{t.parallel.tp}) has no "
                              "TP plan for adapter layers yet", "use d/p/c dims for LoRA with archon (t1), "
                              "or engine=fsdp")
    others = sorted({p.backend for p in plan.inferences if p.backend in LORA_DISK_ONLY_BACKENDS})
    if others and cfg.rollout.weight_update == "distributed":
        raise ConfigError("rollout.weight_update", f"{', '.join(others)} load LoRA adapters from a directory "
                          "(/load_lora_adapter), not from a broadcast",
                          "set rollout.weight_update=disk (an adapter is a few MB), or use the hf backend")
    if cfg.algo.use_critic:
        plan.warnings.append("model.lora: the critic trains all of its weights (the adapter is the "
                             "policy's only)")
