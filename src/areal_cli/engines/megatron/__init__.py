"""The Megatron engine (megatron-core 0.16.1): :mod:`.engine` (``MegatronEngine``), the CPU shim
(:mod:`.compat`), the GPTModel builder (:mod:`.model`), the HF <-> mcore weight converter (:mod:`.convert`)
and routing replay (:mod:`.routing`).

Import-light on purpose: nothing here imports torch or megatron-core at package import, so the CLI never
pays for (or depends on) megatron-core. :data:`SPEC` is the engine's torch-free description (the registry,
``engines/__init__.py``, lists it); it names ``engine:MegatronEngine`` by import path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_cli.api.backend_spec import EngineSpec, PackageNeed, Sharding
from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.engine import EngineConfig

# Said by the validator (which must not import torch) and by the engine.
FULL_RECOMPUTE = ("routing replay does not run with engine.megatron.recompute_granularity=full (mcore "
                  "recomputes the router in the backward pass, after later micro-batches set their routing)")


def check_virtual_stages(virtual_stages: int, p: int) -> None:
    """Virtual stages interleave over pipeline ranks: said by the validator and by the engine."""
    if virtual_stages > 1 and p == 1:
        raise ConfigError("engine.megatron.virtual_stages", f"{virtual_stages} virtual stages need pipeline "
                          "parallelism", "set p > 1 in allocation_mode, or engine.megatron.virtual_stages=1")


def _layers(engine_cfg: EngineConfig, dims: Any, n_layers: int) -> None:
    """mcore splits layers evenly over p × virtual stages (the validator checks that p divides them)."""
    v = int(engine_cfg.megatron.virtual_stages)
    check_virtual_stages(v, dims.p)
    if v > 1 and n_layers % (dims.p * v):
        raise ConfigError("allocation_mode.spec", f"p{dims.p} × {v} virtual stages does not divide "
                          f"num_hidden_layers={n_layers}", "use p × engine.megatron.virtual_stages dividing the layers")


def _constraint(dims: Any) -> str | None:
    if dims.c > 1:
        return ("megatron-core's context parallelism needs TransformerEngine's attention, and engine=megatron "
                "does not run it in this release; drop c, or use engine=archon for Ulysses context parallelism")
    return None


def _knobs(engine_cfg: EngineConfig) -> None:
    from areal_cli.engines.specs import fsdp2_grad_reduce_only, fsdp_tied_head_only

    fsdp2_grad_reduce_only(engine_cfg, "megatron", "mcore's DDP reduces its gradient buffers once per step")
    fsdp_tied_head_only(engine_cfg, "megatron", "mcore splits the vocabulary over its TP group")


def _routing_replay(engine_cfg: EngineConfig) -> None:
    if engine_cfg.gradient_checkpointing and engine_cfg.megatron.recompute_granularity == "full":
        raise ConfigError("rollout.routing_replay", FULL_RECOMPUTE, "set engine.megatron.recompute_granularity="
                          "selective or rollout.routing_replay=false")


def _sharding(engine_cfg: EngineConfig) -> Sharding:
    optimizer = bool(getattr(getattr(engine_cfg, "megatron", None), "use_distributed_optimizer", True))
    return Sharding(weights=False, grads=False, optimizer=optimizer, gathers_layers=False)


# c is in the dims so that a spec with c gets the constraint's reason, not "does not support context".
SPEC = EngineSpec(
    "megatron", "areal_cli.engines.megatron.engine:MegatronEngine", "dtpce", _sharding, "megatron",
    "megatron-core TP/PP (+ virtual stages)/DP with a distributed optimizer",
    constraint=_constraint, check_layers=_layers, check_config=_knobs,
    routing_replay="dtpce", check_routing_replay=_routing_replay,  # mcore's router-replay seam (.routing)
    hybrid_moe=True, c_splits_heads=False, flash_shared_prefix=True, critic=True,
    full_recompute=lambda e: e.megatron.recompute_granularity == "full",  # "selective": core attention only
    package=PackageNeed("megatron.core", "megatron-core",
                        "pip install 'areal-cli[megatron]' (or AREAL_EXTRAS=megatron bash scripts/install.sh)"))
