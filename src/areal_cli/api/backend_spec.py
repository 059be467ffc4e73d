"""The contract of a backend's spec: what the CLI, the validator, the estimator, the planner and the launcher
know about a training engine (:class:`EngineSpec`) or an inference backend (:class:`InferenceBackendSpec`).

Each backend writes one spec in its own folder; its registry (``engines/__init__.py:ENGINES``,
``inference/backends/__init__.py:INFERENCE_BACKENDS``) lists it by name in one line. Rules ask a spec's
fields (dims, capabilities), never a backend's name. No torch here, nor in any spec module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PackageNeed:
    """A Python package a backend needs, checked before launch (plan/packages.py)."""

    module: str  # the import name (dotted for a submodule)
    dist: str  # the name pip knows
    fix: str


# ---------------------------------------------------------------------------------------------- training


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
    # --- capabilities (validation asks these, never the name)
    lora: str = ""  # the dims under which it trains LoRA adapters ("": it does not)
    routing_replay: str = ""  # the dims under which its forward replays recorded MoE routing ("": none)
    vision: str = ""  # the dims under which it trains vision-language models on image batches ("": it does not)
    # engine config -> raises ConfigError where its own knobs rule routing replay out
    check_routing_replay: Callable[[Any], None] | None = None
    hybrid_moe: bool = False  # runs the allocation form (attn:…|ffn:…) with the experts' own dims
    # c splits attention heads over the context ranks (Ulysses), so c × t must fit the heads; False: c cuts
    # the sequence (ring attention) and leaves the heads whole
    c_splits_heads: bool = True
    # keeps engine.shared_prefix under flash attention (its kernel takes the shared-prefix mask)
    flash_shared_prefix: bool = False
    # engine config -> whether engine.gradient_checkpointing recomputes whole layers (the planner's cost);
    # None: always (HF-module engines checkpoint each decoder layer)
    full_recompute: Callable[[Any], bool] | None = None
    # its recover state is torch DCP under HF parameter names, so `areal export` can turn it into an HF dir
    dcp_checkpoint: bool = False
    # trains a value head in the LM head's place (``critic=True``): PPO's critic, algo=rm's reward model
    critic: bool = False
    package: PackageNeed | None = None  # beyond torch, checked before launch

    @property
    def trainable(self) -> bool:
        return self.target is not None


# ---------------------------------------------------------------------------------------------- inference


@dataclass(frozen=True)
class ServerArgs:
    """What the launcher decides for one server; a backend's ``server_cmd`` turns it into its command line."""

    model_path: str
    host: str
    port: int
    tp: int = 1
    pp: int = 1
    dtype: str = "float32"  # normalised: auto | float32 | bfloat16 | float16
    device: str = "cpu"
    seed: int = 0
    context_length: int | None = None
    python: str | None = None  # the interpreter to run it with; None: the backend's own choice
    cache_root: str | None = None
    lora_rank: int = 0  # > 0: the server loads LoRA adapters at run time
    lora_targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class InferenceBackendSpec:
    """Everything the CLI, validator, estimator, planner and launcher know about one inference backend.

    Torch-free: it lives in the backend's own module next to its payload builders (``module``), and the
    registry (``inference/backends/__init__.py``) lists it by name. Rules ask these fields, never the name."""

    name: str
    module: str  # the module holding the payload builders the client calls (INTERFACE)
    # (ServerArgs) -> (argv, env to add); the launcher adds the API key and launcher.server_args after it
    server_cmd: Callable[[ServerArgs], tuple[list[str], dict[str, str]]]
    dims: str = "dtpe"  # allocation dims it runs; inference never uses c
    dims_hint: str = ""  # the fix shown when a spec uses another dim ("" : "<name> supports d, t, ...")
    summary: str = ""
    # Fraction of device memory the server claims for weights + KV cache (the estimator's KV budget).
    mem_fraction: float = 0.9
    reserves_memory: bool = True  # claims mem_fraction at start (False: allocates on demand)
    weight_broadcast: bool = True  # joins the trainer's broadcast group for full weights (else disk only)
    lora_broadcast: bool = False  # takes a LoRA adapter over that group (else from a directory)
    batch_generate: bool = False  # one request carries a group's samples (the planner's request count)
    gpu_only: bool = False  # no CPU build: a spec naming it is a GPU plan
    sampling_mask: bool = False  # records the Keep-Sampling-Mask (rollout.keep_sampling_mask)
    routed_experts: bool = False  # returns routed experts (rollout.routing_replay)
    images: bool = False  # carries a prompt's images (ModelRequest.image_data; docs/vision.md)
    max_concurrency: int | None = None  # a cap rollout.max_concurrent_rollouts=auto keeps to
    cpu_note: str = ""  # a plan warning on cluster.device=cpu (what it needs there)
    package: PackageNeed | None = None  # checked before launch; None: ships with areal_cli
    python: Callable[[], str] | None = None  # the interpreter its package is checked in (None: this one)

    def dims_fix(self, letter: str, value: int) -> str:
        if self.dims_hint:
            return self.dims_hint
        return f"{self.name} supports {', '.join(self.dims)}; drop {letter}{value}"
