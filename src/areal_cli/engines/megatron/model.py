"""Build megatron-core ``GPTModel`` chunks from a Hugging Face config (dense Qwen2/Qwen2.5, Qwen3, Llama, and
the Qwen3-MoE family with mcore's MoE layers).

:func:`hf_arch` reads the HF config into an :class:`HFArch` and refuses what the mcore model cannot
reproduce exactly (a typed error naming the supported families). :func:`transformer_config` maps it to a
``TransformerConfig``; :func:`build_chunks` builds this rank's pipeline chunks (one per virtual stage).
``engine.attn_impl`` picks the spec and its core attention: sdpa and eager run the local layer spec (with
:func:`sdpa_core_attention`, or mcore's own eager ``DotProductAttention``), flash_attention_2 TransformerEngine's
spec with its flash backend (TE's fused layer-norm parameter names are handled by :mod:`.convert`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_cli.errors import ConfigError

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")
# mcore's RotaryEmbedding._apply_scaling hard-codes Llama-3.1's scaling constants
# (models/common/embeddings/rotary_pos_embedding.py:92-98); only that rope_type with these values is exact.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ConfigError):
    """The HF model cannot be built as an mcore GPTModel exactly."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__("model.path", reason, hint or f"engine=megatron supports the families "
                         f"{', '.join(SUPPORTED_FAMILIES)}; use engine=fsdp or engine=archon for others")


@dataclass(frozen=True)
class HFArch:
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama-3 rope scaling, else None
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    # MoE (qwen3_moe): every layer's MLP is num_experts experts, top-k routed; 0 for dense models
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = True  # renormalise the top-k router probabilities (Qwen3-MoE's norm_topk_prob)


def _rope(cfg: Any) -> tuple[float, float | None]:
    # transformers 5 keeps rope in `rope_parameters`; older ones in `rope_theta` + `rope_scaling`
    rp = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if kind == "default":
        return theta, None
    if kind == "llama3" and all(float(rp.get(k, -1)) == v for k, v in _LLAMA3_ROPE.items()):
        return theta, float(rp["factor"])
    raise UnsupportedModelError(f"rope scaling {rp} is not reproduced by megatron-core",
                                "use a model with default rope or Llama-3.1-style scaling "
                                f"({_LLAMA3_ROPE})")


def hf_arch(cfg: Any) -> HFArch:
    """Read an HF ``PretrainedConfig`` (or its dict form via ``transformers.AutoConfig``)."""
    family = getattr(cfg, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(f"model_type {family!r} is not supported by engine=megatron")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r}: only silu (SwiGLU) is supported")
    moe = _moe_fields(cfg, family)
    if getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError("sliding-window attention is not reproduced by the local layer spec",
                                    "set use_sliding_window=false in the model's config.json")
    if family == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    else:
        # Qwen3/Llama `attention_bias` also puts a bias on o_proj, which mcore's qkv-only bias cannot hold
        if getattr(cfg, "attention_bias", False):
            raise UnsupportedModelError(f"{family} with attention_bias=true is not supported")
        qkv_bias = False
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    heads = int(cfg.num_attention_heads)
    theta, factor = _rope(cfg)
    return HFArch(
        family=family, hidden_size=int(cfg.hidden_size), num_layers=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        ffn_hidden_size=int(cfg.intermediate_size), vocab_size=int(cfg.vocab_size),
        rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, rope_scaling_factor=factor,
        max_position_embeddings=int(cfg.max_position_embeddings),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"), **moe)


def _moe_fields(cfg: Any, family: str) -> dict[str, Any]:
    if family != "qwen3_moe":
        if getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0):
            raise UnsupportedModelError(f"mixture-of-experts {family} models are not supported",
                                        "engine=megatron runs MoE models of the qwen3_moe family")
        return {}
    if int(getattr(cfg, "decoder_sparse_step", 1)) != 1 or list(getattr(cfg, "mlp_only_layers", []) or []):
        raise UnsupportedModelError("qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                                    "is not supported", "use a model whose every layer is an MoE layer")
    return {"num_experts": int(cfg.num_experts), "moe_top_k": int(cfg.num_experts_per_tok),
            "moe_ffn_hidden_size": int(cfg.moe_intermediate_size),
            "moe_norm_topk": bool(getattr(cfg, "norm_topk_prob", True))}


def check_layout(arch: HFArch, tp: int, pp: int, vpp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """Refuse a TP/PP/VPP/EP layout the model's shapes cannot be split into."""
    dims = [("num_key_value_heads", arch.num_kv_heads, tp, "t"), ("num_attention_heads", arch.num_heads, tp, "t"),
            ("vocab_size", arch.vocab_size, tp, "t")]
    if arch.num_experts:
        dims += [("num_experts", arch.num_experts, ep, "e"),
                 ("moe_intermediate_size", arch.moe_ffn_hidden_size, etp or tp, "expert t")]
    else:
        dims += [("intermediate_size", arch.ffn_hidden_size, tp, "t")]
        if ep > 1:
            raise ConfigError("allocation_mode.spec", f"e{ep} needs an MoE model, but this one is dense",
                              "drop e")
    for what, n, k, letter in dims:
        if n % k:
            raise ConfigError("allocation_mode.spec", f"{letter}{k} does not divide {what}={n}",
                              f"use a {letter} size that divides {n}")
    stages = pp * vpp
    if arch.num_layers % stages:
        raise ConfigError("allocation_mode.spec", f"p{pp} × {vpp} virtual stages does not divide "
                          f"num_hidden_layers={arch.num_layers}",
                          "use p × virtual stages dividing the layers")


def _moe_config(arch: HFArch, ep: int, etp: int | None, aux_loss_coeff: float) -> dict[str, Any]:
    if not arch.num_experts:
        return {}
    return dict(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        # HF: softmax over all experts, top-k, renormalised when norm_topk_prob; mcore's default (softmax over
        # the top-k logits) is the renormalised form, pre-softmax the other
        moe_router_pre_softmax=not arch.moe_norm_topk, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        # SequentialMLP: one plain MLP per local expert (grouped GEMM needs TransformerEngine or CUTLASS)
        moe_grouped_gemm=False, moe_permute_fusion=False,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def _no_init(weight: Any) -> None:
    """An init method that leaves the weight as allocated: for weights loaded right after the build. On a CPU
    host mcore initialises each tensor-parallel weight by drawing its whole unsharded master and copying this
    rank's slice out (``_initialize_affine_weight_cpu``): a ``[V, H]`` draw for the embedding and the head.
    Skipping it saves that time (megatron t2p2 init 15.9 -> 13.0 s on a 0.5B model); the init's memory peak
    was DDP's buffers instead (:func:`hollow`), and this alone left it unchanged (2.17 GiB, measured)."""


def hollow(chunks: list) -> int:
    """Give every parameter of ``chunks`` a one-element storage (all strides 0) in place of its weights, before
    mcore's DDP under the distributed optimizer copies each parameter into its contiguous buffer and frees the
    original (``param_and_grad_buffer.py``): the weights are then loaded into the buffer's views. Loaded
    before it, every weight was held twice while the buffer filled, on top of the gradient buffer: the
    megatron t2p2 init peak of a 0.5B model, 2.17 GiB per rank against 1.96 (docs/training.md). Only for the
    distributed optimizer's DDP (it remaps ``param.data``); every weight must be loaded afterwards
    (``convert.load_hf`` checks that all are). Returns how many parameters."""
    import torch

    n = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.data = torch.empty_strided(p.shape, (0,) * p.dim(), dtype=p.dtype, device=p.device)
            n += 1
    return n


# Batched p2p under gloo with virtual stages swaps activations and grads silently
# (p2p_communication.py:16-46); the unbatched path is exact. A module constant, not a config knob, so that
# test_megatron_engine.py can show the batched path is still wrong (and say so when an upgrade fixes it).
BATCH_P2P_COMM = False


def transformer_config(arch: HFArch, *, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                       etp: int | None = None, sequence_parallel: bool = False, dtype: Any = None,
                       aux_loss_coeff: float = 0.0, attn_impl: str = "sdpa", wgrad_into_main_grad: bool = False,
                       loaded: bool = False) -> Any:
    """mcore's config for ``arch``. ``wgrad_into_main_grad`` (a training engine, under DDP): linear layers add
    their weight gradients straight into DDP's buffer (mcore's gradient_accumulation_fusion, grad_memory.py).
    ``loaded``: every weight is read from a checkpoint right after the build (``convert.load_hf`` checks that
    all are covered), so mcore's random init is skipped (:func:`_no_init`)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_layout(arch, tp, pp, vpp, ep, etp)
    dtype = dtype or torch.float32
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        # dropout 0: RL fine-tuning uses none, and the CPU RNG tracker (compat) forks nothing
        hidden_dropout=0.0, attention_dropout=0.0,
        # the fused kernels are CUDA-only; the unfused paths are the exact ones
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=wgrad_into_main_grad,
        use_cpu_initialization=not torch.cuda.is_available(),
        **({"init_method": _no_init, "output_layer_init_method": _no_init, "embedding_init_method": _no_init}
           if loaded else {}),
        # perform_initialization=False skips set_tensor_model_parallel_attributes
        # (tensor_parallel/layers.py:244, :855, :1178): sharded weights would count as TP duplicates in grad
        # norms and export gathers
        perform_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        variable_seq_lengths=True,
        # transformer_config.py:1827 rejects variable_seq_lengths with the default allgather dispatcher, even
        # for dense models
        moe_token_dispatcher_type="alltoall",
        batch_p2p_comm=BATCH_P2P_COMM,
        attention_backend=attention_backend(attn_impl),
        **_moe_config(arch, ep, etp, aux_loss_coeff),
    )


def _local_norm_cls() -> Any:
    """torch's RMSNorm behind mcore's norm constructor. mcore's own torch fallback (``WrappedTorchNorm``)
    refuses sequence parallelism; this one marks its weight ``sequence_parallel`` instead, which is what
    ``finalize_model_grads`` reads to sum the norm's gradients over the t ranks (each saw 1/t of the tokens)."""
    import torch

    class SequenceParallelRMSNorm(torch.nn.RMSNorm):
        def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
            super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
            self.weight.sequence_parallel = bool(config.sequence_parallel)

    return SequenceParallelRMSNorm


def attention_backend(attn_impl: str) -> Any:
    """mcore's ``TransformerConfig.attention_backend`` for ``engine.attn_impl``: flash_attention_2 is
    TransformerEngine's flash backend (TE's layer spec); sdpa and eager are core-attention modules of the
    local spec (``local``: mcore sets TE's NVTE_*_ATTN switches off and uses the spec's module)."""
    from megatron.core.transformer.enums import AttnBackend

    from areal_cli.engines import attn_impl as ai

    return AttnBackend.flash if attn_impl == ai.FLASH else AttnBackend.local


def uses_te(attn_impl: str) -> bool:
    """TransformerEngine's layer spec runs flash_attention_2 only (the engine refuses that without TE); sdpa
    and eager are the local spec's, which has the kernels they name."""
    from areal_cli.engines import attn_impl as ai

    return attn_impl == ai.FLASH


_SDPA_CLS: list[Any] = []


def sdpa_core_attention() -> Any:
    """mcore's local ``DotProductAttention`` (the eager kernel: baddbmm, masked softmax, bmm) with its
    forward replaced by ``torch.nn.functional.scaled_dot_product_attention``: the same inputs (``[s, b, n, h]``
    query/key/value, a boolean mask with True = hidden, or causal without one), the same output ``[s, b, n·h]``."""
    if _SDPA_CLS:
        return _SDPA_CLS[0]
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None or self.softmax_offset is not None:
                raise NotImplementedError("the sdpa core attention takes no packed sequences, attention bias "
                                          "or softmax offset (engine=megatron sets none of them)")
            rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if rep > 1:  # grouped kv heads, repeated as the eager module does
                key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, h]
            # the eager module divides the scale by layer_number and its softmax multiplies it back
            scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
                dropout_p=self.attention_dropout.p if self.training else 0.0,
                is_causal=attention_mask is None, scale=scale)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], self.hidden_size_per_partition)

    _SDPA_CLS.append(SDPAttention)
    return SDPAttention


def layer_spec(arch: HFArch, use_te: bool | None = None, attn_impl: str = "sdpa") -> Any:
    if use_te is None:
        use_te = uses_te(attn_impl)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=arch.num_experts or None,
                                                          moe_grouped_gemm=False, qk_layernorm=arch.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from areal_cli.engines import attn_impl as ai

    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                    normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    norm = _local_norm_cls()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
    attn = spec.submodules.self_attention.submodules
    if arch.qk_norm:  # per-head norms see whole sequences; mcore sums their grads over t by name
        attn.q_layernorm = attn.k_layernorm = norm
    if attn_impl == ai.SDPA:  # eager is the local spec's own DotProductAttention
        attn.core_attention = sdpa_core_attention()
    return spec


def _block_spec(layer: Any, config: Any, vp_stage: int | None, use_te: bool) -> Any:
    """The local spec's block with our norm as the final norm (mcore's default would be WrappedTorchNorm)."""
    if use_te:
        return layer
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=_local_norm_cls())


def build_chunks(arch: HFArch, config: Any, *, use_te: bool | None = None, attn_impl: str = "sdpa") -> list[Any]:
    """This rank's GPTModel chunks (one per virtual stage), after ``initialize_model_parallel``.

    Chunk c of PP rank r holds global layers ``[(c·pp + r)·n, (c·pp + r + 1)·n)``, n = layers/(pp·vpp);
    each layer's own ``layer_number`` records that offset, which is what :mod:`.convert` reads.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    pp = mpu.get_pipeline_model_parallel_world_size()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    vpp = config.virtual_pipeline_model_parallel_size or 1
    use_te = uses_te(attn_impl) if use_te is None else use_te
    spec = layer_spec(arch, use_te, attn_impl)
    chunks = []
    for c in range(vpp):
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=_block_spec(spec, config, c if vpp > 1 else None, use_te),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings, pre_process=pp_rank == 0 and c == 0,
            post_process=pp_rank == pp - 1 and c == vpp - 1, share_embeddings_and_output_weights=arch.tied,
            position_embedding_type="rope", rotary_base=arch.rope_theta,
            rope_scaling=arch.rope_scaling_factor is not None,
            rope_scaling_factor=arch.rope_scaling_factor or 8.0,
            vp_stage=c if vpp > 1 else None))
        if chunks[-1].post_process:
            fp32_output(chunks[-1].output_layer)
    return chunks


_FP32_OUTPUT: dict[type, type] = {}


def fp32_output(layer: Any) -> Any:
    """The vocab-parallel output layer computing its logits in fp32 (engines/precision.py: bf16 logits move a
    logprob by up to ~0.06 nats near |logit| 20). The hidden states and the weight (the layer's own, or the
    tied embedding mcore passes in) are upcast exactly; the class is swapped as :func:`.precision.fp32_head`."""
    import torch

    cls = type(layer)
    if cls in _FP32_OUTPUT.values():
        return layer

    def forward(self: Any, input_: Any, weight: Any = None, runtime_gather_output: Any = None) -> Any:
        w = self.weight if weight is None else weight
        wf = w.float()
        if wf is not w and getattr(w, "main_grad", None) is not None:
            # a bf16 weight's fp32 copy: mcore's gradient_accumulation_fusion adds its fp32 weight gradient
            # straight into the weight's fp32 buffer (grad_memory.py), so none flows back through the cast
            wf.main_grad = w.main_grad
        with torch.autocast(input_.device.type, enabled=False):
            return cls.forward(self, input_.float(), weight=wf, runtime_gather_output=runtime_gather_output)

    if cls not in _FP32_OUTPUT:
        _FP32_OUTPUT[cls] = type(f"FP32{cls.__name__}", (cls,), {"forward": forward})
    layer.__class__ = _FP32_OUTPUT[cls]
    return layer
