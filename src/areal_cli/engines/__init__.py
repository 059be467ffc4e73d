"""Training backends behind one registry: one :class:`EngineSpec` per backend.

The spec is the single place that says what a backend is. The allocation parser reads its dims, the
validator its dims and config section, the memory estimator its sharding model, and the trainer its
class. Import-light: no torch here, so the CLI can validate without it; the class is imported only
when a trainer process builds the engine.

A backend outside this package is named by import path, ``engine.name=pkg.module:Class``; the trainer's
child processes import it by that name, so nothing needs registering in them. Its class may declare
``dims`` (the allocation dims it runs, default ``"d"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable

from areal_cli.errors import ConfigError


@dataclass(frozen=True)
class Sharding:
    """Which training state a backend shards over the data-parallel (× context) ranks, for the
    memory estimate; tensor and pipeline sharding follow from the dims themselves."""

    weights: bool
    grads: bool
    optimizer: bool
    gathers_layers: bool  # unsharded layers are gathered one or two at a time (FSDP-style prefetch)
    # the expert ranks e are taken from the d×c ranks that shard the state (archon, torchtitan): experts are
    # sharded over d×c in all (e × d×c/e), not e × d×c
    experts_share_dc: bool = False


FULL_SHARD = Sharding(weights=True, grads=True, optimizer=True, gathers_layers=True)
# Archon: e borrows from d×c, so experts cut over e are FSDP-sharded over the remaining d×c/e ranks only
ARCHON_SHARD = Sharding(weights=True, grads=True, optimizer=True, gathers_layers=True, experts_share_dc=True)


ARCHON_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")


def _archon_layers(engine_cfg: Any, dims: Any, n_layers: int) -> None:
    """Archon cuts layers into p × virtual stages, evenly (remainder allowed) or as configured."""
    a = engine_cfg.archon
    if a.pp_schedule not in ARCHON_SCHEDULES:
        raise ConfigError("engine.archon.pp_schedule", f"unknown pipeline schedule {a.pp_schedule!r}",
                          f"use one of: {', '.join(ARCHON_SCHEDULES)}")
    v = int(a.pp_virtual_stages)
    if a.pp_schedule == "Interleaved1F1B" and v < 2:
        raise ConfigError("engine.archon.pp_virtual_stages", f"Interleaved1F1B needs at least 2 stages per rank, "
                          f"got {v}", "set engine.archon.pp_virtual_stages=2 or use pp_schedule=1F1B")
    if a.pp_schedule != "Interleaved1F1B" and v != 1:
        raise ConfigError("engine.archon.pp_virtual_stages", f"{a.pp_schedule} runs one stage per rank, got {v}",
                          "use pp_schedule=Interleaved1F1B for virtual stages, or set pp_virtual_stages=1")
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


def _fsdp2_grad_reduce_only(engine_cfg: Any, name: str, why: str) -> None:
    """``engine.grad_reduce`` picks FSDP2's reduce-scatter schedule: another backend refuses a non-default value."""
    mode = getattr(engine_cfg, "grad_reduce", "per_micro_batch")
    if mode != "per_micro_batch":
        raise ConfigError("engine.grad_reduce", f"{mode!r} is an FSDP2 setting (engine=fsdp or archon); {why}",
                          f"leave engine.grad_reduce=per_micro_batch with engine={name}")


def check_megatron_knobs(engine_cfg: Any) -> None:
    _fsdp2_grad_reduce_only(engine_cfg, "megatron", "mcore's DDP reduces its gradient buffers once per step")


def check_deepspeed_knobs(engine_cfg: Any) -> None:
    """The ``engine.deepspeed`` knobs that depend on each other."""
    _fsdp2_grad_reduce_only(engine_cfg, "deepspeed", "DeepSpeed reduces at its own accumulation boundary")
    z = engine_cfg.deepspeed
    if z.offload_param and z.zero_stage != 3:
        raise ConfigError("engine.deepspeed.offload_param", f"parameter offload needs ZeRO-3, got zero_stage="
                          f"{z.zero_stage}", "set engine.deepspeed.zero_stage=3 or drop offload_param")
    if z.offload_optimizer and z.zero_stage == 0:
        raise ConfigError("engine.deepspeed.offload_optimizer", "optimizer offload needs ZeRO-1 or higher",
                          "set engine.deepspeed.zero_stage to 1, 2 or 3, or drop offload_optimizer")


def _megatron_layers(engine_cfg: Any, dims: Any, n_layers: int) -> None:
    """mcore splits layers evenly over p × virtual stages (the validator checks that p divides them)."""
    v = int(engine_cfg.megatron.virtual_stages)
    if v > 1 and dims.p == 1:
        raise ConfigError("engine.megatron.virtual_stages", f"{v} virtual stages need pipeline parallelism",
                          "set p > 1 in allocation_mode, or engine.megatron.virtual_stages=1")
    if v > 1 and n_layers % (dims.p * v):
        raise ConfigError("allocation_mode.spec", f"p{dims.p} × {v} virtual stages does not divide "
                          f"num_hidden_layers={n_layers}", "use p × engine.megatron.virtual_stages dividing the layers")


def _megatron_constraint(dims: Any) -> str | None:
    if dims.c > 1:
        return ("megatron-core's context parallelism needs TransformerEngine's attention, and engine=megatron "
                "does not run it in this release; drop c, or use engine=archon for Ulysses context parallelism")
    return None


def _deepspeed_sharding(engine_cfg: Any) -> Sharding:
    z = int(getattr(getattr(engine_cfg, "deepspeed", None), "zero_stage", 3))
    return Sharding(weights=z >= 3, grads=z >= 2, optimizer=z >= 1, gathers_layers=z >= 3)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    target: str | None  # "module:Class"; None: planned and validated, not trainable in this release
    dims: str  # allocation dims it runs, a subset of "dtpce" (d is always allowed)
    sharding: Callable[[Any], Sharding]  # engine config -> what is sharded over d×c
    config_key: str | None = None  # engine.<key>: the dataclass section holding its own knobs
    summary: str = ""
    # dims (d, t, p, c, e attributes) -> why this combination cannot run, or None
    constraint: Callable[[Any], str | None] | None = None
    # (engine config, dims, num_hidden_layers) -> raises ConfigError for the engine's own layer-split rules
    check_layers: Callable[[Any, Any, int], None] | None = None
    # the engine splits layers over p unevenly (its check_layers decides): no "p divides the layers" rule
    uneven_layers: bool = False
    # engine config -> raises ConfigError for knobs of its own section that contradict each other
    check_config: Callable[[Any], None] | None = None

    @property
    def trainable(self) -> bool:
        return self.target is not None


ENGINE_SPECS: dict[str, EngineSpec] = {
    spec.name: spec for spec in (
        EngineSpec("fsdp", "areal_cli.engines.fsdp:FSDPEngine", "dc", lambda _: FULL_SHARD, None,
                   "PyTorch FSDP2 data parallel with Ulysses context parallel"),
        EngineSpec("megatron", "areal_cli.engines.megatron.engine:MegatronEngine", "dtpce",
                   lambda e: Sharding(weights=False, grads=False,
                                      optimizer=bool(getattr(getattr(e, "megatron", None), "use_distributed_optimizer",
                                                             True)), gathers_layers=False),
                   "megatron", "megatron-core TP/PP (+ virtual stages)/DP with a distributed optimizer",
                   constraint=_megatron_constraint, check_layers=_megatron_layers,
                   check_config=check_megatron_knobs),
        EngineSpec("archon", "areal_cli.engines.archon.engine:ArchonEngine", "dtpce", lambda _: ARCHON_SHARD,
                   "archon", "PyTorch-native FSDP2 + DTensor TP + pipelining + Ulysses CP + expert parallel",
                   check_layers=_archon_layers, uneven_layers=True),
        EngineSpec("deepspeed", "areal_cli.engines.deepspeed:DeepSpeedEngine", "dc", _deepspeed_sharding,
                   "deepspeed", "DeepSpeed ZeRO-1/2/3 with Ulysses context parallel (offload on GPU nodes)",
                   check_config=check_deepspeed_knobs),
    )
}
BUILTIN_ENGINES = tuple(ENGINE_SPECS)


def is_import_path(name: str) -> bool:
    return ":" in name and all(part.strip() for part in name.split(":", 1))


def get_engine_spec(name: str) -> EngineSpec:
    """The spec for a built-in backend name or a ``pkg.module:Class`` import path."""
    spec = ENGINE_SPECS.get(name)
    if spec is not None:
        return spec
    if is_import_path(name):
        cls = _import_class(name)
        return EngineSpec(name, name, str(getattr(cls, "dims", "d")), lambda _: FULL_SHARD, None,
                          (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "")
    from areal_cli.errors import did_you_mean

    raise ConfigError("engine.name", f"unknown training engine {name!r}",
                      f"{did_you_mean(name, ENGINE_SPECS)}use one of: {', '.join(ENGINE_SPECS)}, "
                      "or a TrainEngine subclass as pkg.module:Class")


def engine_dims(name: str) -> str:
    return get_engine_spec(name).dims


def trainable_engines() -> list[str]:
    return [n for n, s in ENGINE_SPECS.items() if s.trainable]


def get_engine_cls(name: str):
    """The TrainEngine subclass for ``name``; a typed error for a planned or unknown backend."""
    spec = get_engine_spec(name)
    if spec.target is None:
        raise ConfigError("engine.name", f"the {name!r} training backend is validated and planned "
                          "(validate-config, train --dry-run) but cannot train in this release",
                          f"train with engine={' or engine='.join(trainable_engines())}")
    return _import_class(spec.target)


def _import_class(target: str):
    from areal_cli.api.engine_api import TrainEngine

    mod, _, attr = target.partition(":")
    try:
        cls = getattr(import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError("engine.name", f"cannot import the training engine {target!r} ({e})",
                          "check the module path and that the package is installed in this environment") from None
    if not (isinstance(cls, type) and issubclass(cls, TrainEngine)):
        raise ConfigError("engine.name", f"{target!r} is not a TrainEngine subclass",
                          "point engine.name at a class that implements areal_cli.api.engine_api.TrainEngine")
    return cls
