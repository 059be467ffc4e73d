"""The specs of the single-module engines (``fsdp.py``, ``deepspeed.py``: their modules import torch, so
their torch-free specs live here) and the rule the FSDP2-based engines share. Megatron's and archon's
specs live in their own packages (``engines/megatron/__init__.py``, ``engines/archon/__init__.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_cli.api.backend_spec import FULL_SHARD, EngineSpec, PackageNeed, Sharding
from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.engine import EngineConfig

# What the engines built on HF modules (fsdp, archon, deepspeed) replay: the hook on the HF router their
# MoE blocks call (engines/routing_replay.py).
ALL_DIMS = "dtpce"


def fsdp2_grad_reduce_only(engine_cfg: EngineConfig, name: str, why: str) -> None:
    """``engine.grad_reduce`` picks FSDP2's reduce-scatter schedule: another backend refuses a non-default value."""
    mode = getattr(engine_cfg, "grad_reduce", "per_micro_batch")
    if mode != "per_micro_batch":
        raise ConfigError("engine.grad_reduce", f"{mode!r} is an FSDP2 setting (engine=fsdp or archon); {why}",
                          f"leave engine.grad_reduce=per_micro_batch with engine={name}")


def fsdp_tied_head_only(engine_cfg: EngineConfig, name: str, why: str) -> None:
    """``engine.tied_head=sharded`` is the row-sharded table of fsdp, archon and deepspeed's ZeRO-3: another
    backend refuses it."""
    if getattr(engine_cfg, "tied_head", "auto") == "sharded":
        raise ConfigError("engine.tied_head", f"'sharded' is the row-sharded table of engine=fsdp, archon and "
                          f"deepspeed; {why}",
                          f"leave engine.tied_head=auto with engine={name}")


def check_deepspeed_knobs(engine_cfg: EngineConfig) -> None:
    """The ``engine.deepspeed`` knobs that depend on each other."""
    fsdp2_grad_reduce_only(engine_cfg, "deepspeed", "DeepSpeed reduces at its own accumulation boundary")
    z = engine_cfg.deepspeed
    if getattr(engine_cfg, "tied_head", "auto") == "sharded" and (z.zero_stage != 3 or z.offload_optimizer
                                                                   or z.offload_param):
        raise ConfigError("engine.tied_head", "'sharded' keeps the tied table out of ZeRO-3, row-sharded with its "
                          f"moments on the device; got zero_stage={z.zero_stage}, offload_optimizer="
                          f"{z.offload_optimizer}, offload_param={z.offload_param}",
                          "leave engine.tied_head=auto, or use zero_stage=3 without offload")
    if z.offload_param and z.zero_stage != 3:
        raise ConfigError("engine.deepspeed.offload_param", f"parameter offload needs ZeRO-3, got zero_stage="
                          f"{z.zero_stage}", "set engine.deepspeed.zero_stage=3 or drop offload_param")
    if z.offload_optimizer and z.zero_stage == 0:
        raise ConfigError("engine.deepspeed.offload_optimizer", "optimizer offload needs ZeRO-1 or higher",
                          "set engine.deepspeed.zero_stage to 1, 2 or 3, or drop offload_optimizer")


def _deepspeed_sharding(engine_cfg: EngineConfig) -> Sharding:
    z = int(getattr(getattr(engine_cfg, "deepspeed", None), "zero_stage", 3))
    return Sharding(weights=z >= 3, grads=z >= 2, optimizer=z >= 1, gathers_layers=z >= 3)


FSDP = EngineSpec("fsdp", "areal_cli.engines.fsdp:FSDPEngine", "dc", lambda _: FULL_SHARD, None,
                  "PyTorch FSDP2 data parallel with Ulysses context parallel",
                  lora=ALL_DIMS, routing_replay=ALL_DIMS, dcp_checkpoint=True, critic=True,
                  vision="dc")  # engines/vision.py; tests/integration/engines/test_vision_engines.py

# DeepSpeed inherits fsdp's forward, but routing replay is untested with it, so it does not declare it.
DEEPSPEED = EngineSpec("deepspeed", "areal_cli.engines.deepspeed:DeepSpeedEngine", "dc", _deepspeed_sharding,
                       "deepspeed", "DeepSpeed ZeRO-1/2/3 with Ulysses context parallel (offload on GPU nodes)",
                       check_config=check_deepspeed_knobs, lora=ALL_DIMS, critic=True,
                       package=PackageNeed("deepspeed", "deepspeed",
                                           "DS_BUILD_OPS=0 pip install 'areal-cli[deepspeed]' (or "
                                           "AREAL_EXTRAS=deepspeed bash scripts/install.sh)"))
