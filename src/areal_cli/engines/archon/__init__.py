"""Archon: PyTorch-native parallelism (FSDP2 × TP × PP × CP) applied from outside to HF models.

Modules (import them directly; none imports torch at package import time):

- :mod:`.mesh`: ``ArchonDims`` and the ``(pp, dp, cp, tp)`` ``ArchonMesh``;
- :mod:`.tp_plans`: DTensor tensor-parallel plans per model family;
- :mod:`.vocab_parallel`: vocab-sharded ``lm_head`` and logprobs/entropy without a full-vocab gather;
- :mod:`.pipeline`: ``torch.distributed.pipelining`` stages and schedules for HF causal LMs;
- :mod:`.clip`: gradient-norm clipping over several meshes and pipeline stages;
- :mod:`.parallelize`: TP → activation checkpointing → FSDP2, in torchtitan's order.

:data:`SPEC` is the engine's torch-free description (the registry, ``engines/__init__.py``, lists it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_cli.api.backend_spec import EngineSpec, Sharding
from areal_cli.errors import ConfigError

if TYPE_CHECKING:
    from areal_cli.config.engine import EngineConfig

# Pipeline schedules the engine runs (pipeline.py maps each onto torch's class).
SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")
# e borrows from d×c, so experts cut over e are FSDP-sharded over the remaining d×c/e ranks only
SHARDING = Sharding(weights=True, grads=True, optimizer=True, gathers_layers=True, experts_share_dc=True)


def _layers(engine_cfg: EngineConfig, dims: Any, n_layers: int) -> None:
    """Archon cuts layers into p × virtual stages, evenly (remainder allowed) or as configured."""
    a = engine_cfg.archon
    if a.pp_schedule not in SCHEDULES:
        raise ConfigError("engine.archon.pp_schedule", f"unknown pipeline schedule {a.pp_schedule!r}",
                          f"use one of: {', '.join(SCHEDULES)}")
    v = int(a.pp_virtual_stages)
    if a.pp_schedule == "Interleaved1F1B" and v < 2:
        raise ConfigError("engine.archon.pp_virtual_stages", f"Interleaved1F1B needs at least 2 stages per rank, "
                          f"got {v}", "set engine.archon.pp_virtual_stages=2 or use pp_schedule=1F1B")
    if a.pp_schedule != "Interleaved1F1B" and v != 1:
        raise ConfigError("engine.archon.pp_virtual_stages", f"{a.pp_schedule} runs one stage per rank, got {v}",
                          "use pp_schedule=Interleaved1F1B for virtual stages, or set pp_virtual_stages=1")
    if getattr(engine_cfg, "tied_head", "auto") == "sharded" and dims.p > 1:
        raise ConfigError("engine.tied_head", f"'sharded' keeps the tied table row-sharded over every rank; "
                          f"archon's p{dims.p} stages hold the embedding and the head apart",
                          "leave engine.tied_head=auto with archon pipeline stages, or drop p")
    stages = dims.p * v
    if list(a.pp_layers):
        counts = [int(x) for x in a.pp_layers]
        if dims.p == 1 or len(counts) != stages or min(counts) < 0 or sum(counts) != n_layers:
            raise ConfigError("engine.archon.pp_layers", f"{counts} is not {stages} non-negative layer counts "
                              f"summing to num_hidden_layers={n_layers}",
                              f"give {stages} counts (p × pp_virtual_stages) that add up to {n_layers}, or leave "
                              "it empty for an even split")
    elif stages > n_layers:
        raise ConfigError("allocation_mode.spec", f"p{dims.p} × {v} virtual stages = {stages} pipeline stages for "
                          f"{n_layers} layers", "use fewer stages: p × pp_virtual_stages ≤ num_hidden_layers")


SPEC = EngineSpec(
    "archon", "areal_cli.engines.archon.engine:ArchonEngine", "dtpce", lambda _: SHARDING, "archon",
    "PyTorch-native FSDP2 + DTensor TP + pipelining + Ulysses CP + expert parallel",
    check_layers=_layers, uneven_layers=True,
    lora="dpce",  # no TP plan for adapter layers yet
    # its pipeline path is not wired (each stage would need its layers' share of the routing per micro-batch),
    # nor t (its sequence-parallel regions hand each router a share of the tokens)
    routing_replay="dce", dcp_checkpoint=True, critic=True,
    vision="dtc")  # no p: the tower would have to run inside the first stage (engines/vision.py)
