"""HF <-> megatron-core weight conversion for the dense families of :mod:`.model`, exact both ways.

Own code rather than mbridge: mbridge 0.15.1 builds its own GPTModel with the TransformerEngine spec
(``llm_bridge.py:150``), lacks the local spec's layer-norm names (``input_layernorm``/``pre_mlp_layernorm``)
and would be one more private API pinned with ``--no-deps``. The mapping is small and every rule is here:

- q/k/v are interleaved per query group into ``linear_qkv``: for each of the ``num_kv_heads`` groups,
  ``[q heads of the group; k; v]`` rows; a TP rank holds whole groups (a dim-0 chunk of that layout).
- ``linear_fc1`` holds ``[gate_shard; up_shard]`` per TP rank, not a chunk of ``cat(gate, up)``.
- Column-parallel (dim 0): embedding, output layer, qkv, fc1. Row-parallel (dim 1): proj, fc2.
- Tied embeddings: the first stage's embedding is ``embed_tokens``; under PP the last stage keeps its own
  copy in ``output_layer`` (loaded with the same weight, never exported).
- Layer offsets per PP/VPP rank are read from each layer's ``layer_number`` (1-based, global), so any
  layout mcore builds is converted without recomputing its split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .model import HFArch

_EMB = "embedding.word_embeddings.weight"
_OUT = "output_layer.weight"
_NORM = "decoder.final_layernorm.weight"


def _norm_names(model: Any) -> tuple[str, str]:
    """(input norm, pre-MLP norm) parameter suffixes: the local spec keeps separate norms, TE fuses them
    into the following linear layer."""
    keys = model.state_dict().keys()
    if any(k.endswith("linear_qkv.layer_norm_weight") for k in keys):
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def _layer_map(model: Any) -> list[tuple[int, int]]:
    """(local index j, global HF layer index) for every layer of this chunk."""
    return [(j, int(layer.layer_number) - 1) for j, layer in enumerate(model.decoder.layers)]


def _qkv(arch: HFArch, q: Any, k: Any, v: Any) -> Any:
    """Interleave q/k/v per query group: [q_g; k_g; v_g] for g in groups (weights or biases)."""
    import torch

    g = arch.num_kv_heads
    tail = q.shape[1:]
    return torch.cat([q.reshape(g, -1, *tail), k.reshape(g, -1, *tail), v.reshape(g, -1, *tail)], 1
                     ).reshape(-1, *tail)


def _split_qkv(arch: HFArch, qkv: Any) -> tuple[Any, Any, Any]:
    g, hd = arch.num_kv_heads, arch.head_dim
    per_q = arch.num_heads // g * hd
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, per_q + 2 * hd, *tail).split([per_q, hd, hd], 1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_mcore(hf: Mapping[str, Any], arch: HFArch, model: Any, tp_rank: int, tp: int) -> dict[str, Any]:
    """The state dict of one GPTModel chunk on TP rank ``tp_rank`` from a full HF state dict."""
    import torch

    def col(t: Any) -> Any:
        return t.chunk(tp, 0)[tp_rank].clone()

    def row(t: Any) -> Any:
        return t.chunk(tp, 1)[tp_rank].clone()

    out: dict[str, Any] = {}
    if model.pre_process:
        out[_EMB] = col(hf["model.embed_tokens.weight"])
    if model.post_process:
        out[_NORM] = hf["model.norm.weight"].clone()
        # one stage with tied weights: output_layer is the embedding itself
        if not (arch.tied and model.pre_process):
            out[_OUT] = col(hf["model.embed_tokens.weight" if arch.tied else "lm_head.weight"])
    in_norm, mlp_norm = _norm_names(model)
    for j, i in _layer_map(model):
        p, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        a = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = col(_qkv(
            arch, hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]))
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = col(_qkv(
                arch, hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"]))
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = row(hf[a + "o_proj.weight"])
        out[m + "mlp.linear_fc1.weight"] = torch.cat([col(hf[p + "mlp.gate_proj.weight"]),
                                                      col(hf[p + "mlp.up_proj.weight"])], 0)
        out[m + "mlp.linear_fc2.weight"] = row(hf[p + "mlp.down_proj.weight"])
        out[m + in_norm] = hf[p + "input_layernorm.weight"].clone()
        out[m + mlp_norm] = hf[p + "post_attention_layernorm.weight"].clone()
    return out


def load_hf(models: Iterable[Any], hf: Mapping[str, Any], arch: HFArch, tp_rank: int, tp: int) -> None:
    """Load a full HF state dict into this rank's chunks; every mcore parameter must be covered."""
    for model in models:
        sd = hf_to_mcore(hf, arch, model, tp_rank, tp)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"HF -> mcore conversion mismatch: missing {missing}, unexpected {unexpected}")


def _gather(t: Any, dim: int, group: Any, tp: int) -> Any:
    import torch
    import torch.distributed as dist

    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def mcore_to_hf(models: Iterable[Any], arch: HFArch, tp_group: Any, tp: int) -> dict[str, Any]:
    """The HF tensors this rank's chunks own, TP-gathered (a collective over ``tp_group``: every TP rank
    calls it). Each PP stage returns only its own layers; the union over stages is the full HF dict."""
    out: dict[str, Any] = {}
    for model in models:
        sd = model.state_dict()
        in_norm, mlp_norm = _norm_names(model)
        if model.pre_process:
            out["model.embed_tokens.weight"] = _gather(sd[_EMB], 0, tp_group, tp)
        if model.post_process:
            out["model.norm.weight"] = sd[_NORM].detach().clone()
            if not arch.tied:
                out["lm_head.weight"] = _gather(sd[_OUT], 0, tp_group, tp)
        for j, i in _layer_map(model):
            p, m = f"model.layers.{i}.", f"decoder.layers.{j}."
            a = p + "self_attn."
            names = ["q_proj", "k_proj", "v_proj"]
            qkv = _split_qkv(arch, _gather(sd[m + "self_attention.linear_qkv.weight"], 0, tp_group, tp))
            out.update({f"{a}{n}.weight": t.clone() for n, t in zip(names, qkv)})
            if arch.qkv_bias:
                qkv = _split_qkv(arch, _gather(sd[m + "self_attention.linear_qkv.bias"], 0, tp_group, tp))
                out.update({f"{a}{n}.bias": t.clone() for n, t in zip(names, qkv)})
            if arch.qk_norm:
                out[a + "q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"].detach().clone()
                out[a + "k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"].detach().clone()
            out[a + "o_proj.weight"] = _gather(sd[m + "self_attention.linear_proj.weight"], 1, tp_group, tp)
            gate, up = sd[m + "mlp.linear_fc1.weight"].chunk(2, 0)  # this rank's [gate_shard; up_shard]
            out[p + "mlp.gate_proj.weight"] = _gather(gate, 0, tp_group, tp)
            out[p + "mlp.up_proj.weight"] = _gather(up, 0, tp_group, tp)
            out[p + "mlp.down_proj.weight"] = _gather(sd[m + "mlp.linear_fc2.weight"], 1, tp_group, tp)
            out[p + "input_layernorm.weight"] = sd[m + in_norm].detach().clone()
            out[p + "post_attention_layernorm.weight"] = sd[m + mlp_norm].detach().clone()
    return out
