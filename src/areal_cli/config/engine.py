"""``engine`` group: which training backend runs the model and how.

The top level holds knobs every backend reads. Knobs that belong to one backend live in that
backend's own section (``engine.archon.*``, ``engine.deepspeed.*``, ``engine.megatron.*``), named by its registry entry
(:data:`areal_cli.engines.ENGINE_SPECS`); setting another backend's section is a validation error,
never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.config.ranges import ranged

# The closed value sets of this group's string fields, written once: validation and the engines refer to
# them. Plain str fields, not Literal: OmegaConf 2.3's structured configs reject Literal annotations.
DTYPES = ("float32", "bfloat16")
GRAD_REDUCE_MODES = ("per_micro_batch", "last_micro_batch")
TIED_HEAD_MODES = ("auto", "sharded", "gathered")
RECOMPUTE_GRANULARITIES = ("selective", "full")


@dataclass
class DeepSpeedConfig:
    # ZeRO 1 (optimizer), 2 (+gradients), 3 (+parameters) sharded over d×c
    zero_stage: int = ranged(3, ge=0, le=3)  # 0: plain data parallelism
    # Keep the optimizer's fp32 partition (stage >= 1) / the parameter partition (stage 3) in host
    # memory and step there. For GPU nodes; on a CPU trainer the device memory is host memory already.
    offload_optimizer: bool = False
    offload_param: bool = False
    # ZeRO's communication bucket (reduce-scatter, all-gather), the parameters ZeRO-3 keeps gathered or
    # prefetched at once, and the bucket gathered for HF export and weight sync, in millions of elements.
    # 20M (80 MB in fp32, near HF's hidden^2 "auto" for 7B-32B): 50M put a 0.5B model's d4 step at 3.58 GiB
    # per rank against 3.08 (docs/training.md); larger buckets mean fewer collectives for more memory.
    bucket_mel: float = ranged(20.0, gt=0)
    # ZeRO-3 keeps parameters smaller than this many elements whole on every rank (norms, biases):
    # fewer tiny all-gathers for a little memory.
    param_persistence_threshold: int = ranged(100_000, ge=0)


@dataclass
class ArchonConfig:
    pp_schedule: str = "1F1B"  # 1F1B | Interleaved1F1B | GPipe (with p > 1)
    # Stages per pipeline rank: 1 for 1F1B/GPipe, 2 or more for Interleaved1F1B (virtual stages).
    pp_virtual_stages: int = ranged(1, ge=1)
    # Decoder layers per stage, first to last (p × virtual stages entries); empty = split evenly.
    pp_layers: list[int] = field(default_factory=list)
    # MoE models: weight of the router's load-balancing (aux) loss; 0 turns it off. Logged as moe_aux_loss.
    moe_aux_loss_coeff: float = ranged(0.0, ge=0.0, le=1.0)


@dataclass
class MegatronConfig:
    # Shard the activations outside tensor-parallel matmuls (norms, residuals) over the t ranks (t > 1).
    sequence_parallel: bool = True
    # With engine.gradient_checkpointing: "selective" recomputes core attention, "full" whole layers.
    recompute_granularity: str = "selective"  # one of RECOMPUTE_GRANULARITIES
    # Interleaved 1F1B: model chunks per pipeline rank (p > 1; p × virtual_stages divides the layers).
    virtual_stages: int = ranged(1, ge=1)
    # Shard optimizer state (and fp32 master weights) over the d ranks: mcore's distributed optimizer.
    use_distributed_optimizer: bool = True
    # MoE models: weight of the router's load-balancing (aux) loss; 0 turns it off. Logged as moe/aux_loss.
    moe_aux_loss_coeff: float = ranged(0.0, ge=0.0, le=1.0)


@dataclass
class EngineConfig:
    name: str = "fsdp"  # a registered backend (fsdp | archon | megatron | deepspeed) or pkg.module:Class
    # compute dtype, one of DTYPES. A trained model keeps fp32 master weights, gradients and optimizer
    # state under bfloat16 on every engine; the LM head's logits stay fp32 (engines/precision.py)
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    # Token budget per micro-batch (FFD packing), or auto: validation picks the largest budget whose estimated
    # per-device memory fits with a margin, capped at a minibatch per rank (allocation/autosize.py), and writes
    # the number into the run's config, so engines only ever read an int. Not the default: engines, benchmarks
    # and tools that build an EngineConfig without validating a composed config must get an int.
    max_tokens_per_mb: int | str = ranged(4096, ge=1, also=("auto",))
    pad_to_multiple_of: int = ranged(1, ge=1)
    padding_free: bool = True  # pack sequences without padding where the attention path allows
    # Samples that share a prompt (a GRPO group) run it once per micro-batch: exact, fewer tokens.
    shared_prefix: bool = True
    # FSDP2 (fsdp, archon): reduce-scatter gradients after every micro-batch (each rank keeps only its shard
    # of the accumulated gradient) or only after the last (unsharded gradients held until then)
    grad_reduce: str = "per_micro_batch"  # one of GRAD_REDUCE_MODES
    # fsdp, archon (without p) and deepspeed (ZeRO-3 without offload), a tied embedding and head: the table
    # stays row-sharded over every rank and the tokens move (sharded), or FSDP2 / ZeRO-3 gathers it like any
    # unit (gathered; archon's t splits it then); auto:
    # sharded while ranks x max_tokens_per_mb < 2 x vocab, i.e. while the gathered activations are smaller
    # than the table and its gradient (engines/sharded_vocab.py)
    tied_head: str = "auto"  # one of TIED_HEAD_MODES
    attn_impl: str = "sdpa"  # sdpa | eager | flash_attention_2 (CUDA with flash_attn; docs/training.md)
    archon: ArchonConfig = field(default_factory=ArchonConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
