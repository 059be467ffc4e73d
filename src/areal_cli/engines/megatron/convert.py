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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .model import HFArch

_EMB = "embedding.word_embeddings.weight"
_OUT = "output_layer.weight"
_NORM = "decoder.final_layernorm.weight"
# a critic's value head (engine.py's ValueHead) replaces the output layer: HF keeps it as lm_head.{weight,bias}
_VALUE = ("output_layer.head.weight", "output_layer.head.bias")


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


def hf_to_mcore(hf: Mapping[str, Any], arch: HFArch, model: Any, tp_rank: int, tp: int,
                experts: "ExpertLayout | None" = None) -> dict[str, Any]:
    """The state dict of one GPTModel chunk on TP rank ``tp_rank`` (and, for MoE, expert-parallel rank
    ``experts.ep_rank``) from a full HF state dict."""
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
        if _VALUE[0] in model.state_dict():  # replicated on every TP rank, like the final norm
            out[_VALUE[0]], out[_VALUE[1]] = hf["lm_head.weight"].clone(), hf["lm_head.bias"].clone()
        # one stage with tied weights: output_layer is the embedding itself
        elif not (arch.tied and model.pre_process):
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
        if arch.num_experts:
            out.update(_experts_to_mcore(hf, arch, p, m, experts or ExpertLayout()))
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([col(hf[p + "mlp.gate_proj.weight"]),
                                                          col(hf[p + "mlp.up_proj.weight"])], 0)
            out[m + "mlp.linear_fc2.weight"] = row(hf[p + "mlp.down_proj.weight"])
        out[m + in_norm] = hf[p + "input_layernorm.weight"].clone()
        out[m + mlp_norm] = hf[p + "post_attention_layernorm.weight"].clone()
    return out


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank sits among the experts: ``ep`` ranks hold ``num_experts / ep`` experts each (rank r
    holds experts ``[r·n, (r+1)·n)``, mcore's assignment), each expert cut over ``etp`` ranks like a dense MLP.
    The groups are needed for export only."""

    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1
    ep_group: Any = None
    etp_group: Any = None


def _experts_to_mcore(hf: Mapping[str, Any], arch: HFArch, p: str, m: str, x: ExpertLayout) -> dict[str, Any]:
    """HF's fused experts (``gate_up_proj [E, 2I, H]`` = [gate; up] per expert, ``down_proj [E, H, I]``) and router
    (``gate.weight [E, H]``) into mcore's router and this rank's SequentialMLP experts."""
    import torch

    out = {m + "mlp.router.weight": hf[p + "mlp.gate.weight"].clone()}
    n = arch.num_experts // x.ep
    for j in range(n):
        e = x.ep_rank * n + j
        gate, up, down = _hf_expert(hf, p, e)
        q = f"{m}mlp.experts.local_experts.{j}."
        out[q + "linear_fc1.weight"] = torch.cat([gate.chunk(x.etp, 0)[x.etp_rank], up.chunk(x.etp, 0)[x.etp_rank]], 0)
        out[q + "linear_fc2.weight"] = down.chunk(x.etp, 1)[x.etp_rank].clone()
    return out


def _hf_expert(hf: Mapping[str, Any], p: str, e: int) -> tuple[Any, Any, Any]:
    """(gate [I, H], up [I, H], down [H, I]) of expert e: from a checkpoint's per-expert tensors (the format
    transformers writes and vLLM/SGLang load) or from transformers' in-memory fused ones."""
    fused = p + "mlp.experts.gate_up_proj"
    if fused in hf:
        gate, up = hf[fused][e].chunk(2, 0)
        return gate, up, hf[p + "mlp.experts.down_proj"][e]
    q = f"{p}mlp.experts.{e}."
    return hf[q + "gate_proj.weight"], hf[q + "up_proj.weight"], hf[q + "down_proj.weight"]


def load_hf(models: Iterable[Any], hf: Mapping[str, Any], arch: HFArch, tp_rank: int, tp: int,
            experts: ExpertLayout | None = None) -> None:
    """Load a full HF state dict into this rank's chunks; every mcore parameter must be covered."""
    for model in models:
        sd = hf_to_mcore(hf, arch, model, tp_rank, tp, experts)
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


def hf_tensors(models: Iterable[Any], arch: HFArch, tp_group: Any, tp: int,
               experts: ExpertLayout | None = None) -> list[tuple[str, Callable[[], Any]]]:
    """``(HF name, thunk)`` for every HF tensor this rank's chunks own, in a fixed order. Calling a thunk
    TP-gathers that one tensor (a collective over ``tp_group``: every TP rank calls the same thunks in the
    same order), so an exporter holds one full tensor at a time. Each PP stage lists only its own layers;
    the union over stages is the full HF dict."""
    out: list[tuple[str, Callable[[], Any]]] = []

    def add(name: str, fn: Callable[[], Any]) -> None:
        out.append((name, fn))

    for model in models:
        sd = model.state_dict()
        in_norm, mlp_norm = _norm_names(model)

        def gathered(key: str, dim: int, sd=sd) -> Callable[[], Any]:
            return lambda: _gather(sd[key], dim, tp_group, tp)

        def copied(key: str, sd=sd) -> Callable[[], Any]:
            return lambda: sd[key].detach().clone()

        if model.pre_process:
            add("model.embed_tokens.weight", gathered(_EMB, 0))
        for j, i in _layer_map(model):
            p, m = f"model.layers.{i}.", f"decoder.layers.{j}."
            a = p + "self_attn."
            for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
                qkv = _qkv_parts(arch, gathered(m + f"self_attention.linear_qkv.{kind}", 0))
                for n, fn in zip(("q_proj", "k_proj", "v_proj"), qkv):
                    add(f"{a}{n}.{kind}", fn)
            if arch.qk_norm:
                add(a + "q_norm.weight", copied(m + "self_attention.q_layernorm.weight"))
                add(a + "k_norm.weight", copied(m + "self_attention.k_layernorm.weight"))
            add(a + "o_proj.weight", gathered(m + "self_attention.linear_proj.weight", 1))
            if arch.num_experts:
                x = experts or ExpertLayout()
                add(p + "mlp.gate.weight", copied(m + "mlp.router.weight"))
                for name, fn in _expert_parts(sd, m, x, arch):
                    add(p + name, fn)
                add(p + "input_layernorm.weight", copied(m + in_norm))
                add(p + "post_attention_layernorm.weight", copied(m + mlp_norm))
                continue
            fc1 = sd[m + "mlp.linear_fc1.weight"]  # this rank's [gate_shard; up_shard]
            add(p + "mlp.gate_proj.weight", lambda t=fc1: _gather(t.chunk(2, 0)[0], 0, tp_group, tp))
            add(p + "mlp.up_proj.weight", lambda t=fc1: _gather(t.chunk(2, 0)[1], 0, tp_group, tp))
            add(p + "mlp.down_proj.weight", gathered(m + "mlp.linear_fc2.weight", 1))
            add(p + "input_layernorm.weight", copied(m + in_norm))
            add(p + "post_attention_layernorm.weight", copied(m + mlp_norm))
        if model.post_process:
            add("model.norm.weight", copied(_NORM))
            if _VALUE[0] in sd:
                add("lm_head.weight", copied(_VALUE[0]))
                add("lm_head.bias", copied(_VALUE[1]))
            elif not arch.tied:
                add("lm_head.weight", gathered(_OUT, 0))
    return out


def _expert_parts(sd: Mapping[str, Any], m: str, x: ExpertLayout,
                  arch: HFArch) -> list[tuple[str, Callable[[], Any]]]:
    """Per-expert HF tensors (``experts.{e}.{gate,up,down}_proj.weight``, the checkpoint format) of one layer.
    The first thunk gathers the layer's experts (over etp, then ep); the last one frees them."""
    box: dict[str, Any] = {}
    names = [(e, k) for e in range(arch.num_experts) for k in ("gate_proj", "up_proj", "down_proj")]

    def part(i: int) -> Callable[[], Any]:
        def fn() -> Any:
            if not box:
                box["fc1"] = _experts_from_mcore(sd, m, x, arch, "fc1")
                box["fc2"] = _experts_from_mcore(sd, m, x, arch, "fc2")
            e, k = names[i]
            t = box["fc2"][e] if k == "down_proj" else box["fc1"][e].chunk(2, 0)[k == "up_proj"]
            t = t.clone()
            if i == len(names) - 1:
                box.clear()
            return t
        return fn

    return [(f"mlp.experts.{e}.{k}.weight", part(i)) for i, (e, k) in enumerate(names)]


def _experts_from_mcore(sd: Mapping[str, Any], m: str, x: ExpertLayout, arch: HFArch, which: str) -> Any:
    """All experts of one layer in HF's fused layout: each local expert gathered over etp, then the local
    experts gathered over ep (a collective over both groups)."""
    import torch

    local = []
    for j in range(arch.num_experts // x.ep):
        w = sd[f"{m}mlp.experts.local_experts.{j}.linear_{which}.weight"]
        if which == "fc1":  # this rank's [gate_shard; up_shard]
            gate, up = w.chunk(2, 0)
            local.append(torch.cat([_gather(gate, 0, x.etp_group, x.etp), _gather(up, 0, x.etp_group, x.etp)], 0))
        else:
            local.append(_gather(w, 1, x.etp_group, x.etp))
    return _gather(torch.stack(local), 0, x.ep_group, x.ep)


def _qkv_parts(arch: HFArch, fused: Callable[[], Any]) -> list[Callable[[], Any]]:
    """Three thunks over one gather of the fused qkv tensor (the gather runs on the first call)."""
    box: list[Any] = []

    def part(k: int) -> Callable[[], Any]:
        def fn() -> Any:
            if not box:
                box.extend(_split_qkv(arch, fused()))
            t = box[k].clone()
            if k == 2:
                box.clear()
            return t
        return fn

    return [part(0), part(1), part(2)]


def mcore_to_hf(models: Iterable[Any], arch: HFArch, tp_group: Any, tp: int,
                experts: ExpertLayout | None = None) -> dict[str, Any]:
    """The HF tensors this rank's chunks own, TP-gathered (a collective over ``tp_group``: every TP rank
    calls it), as one dict; see :func:`hf_tensors`."""
    return {name: fn() for name, fn in hf_tensors(models, arch, tp_group, tp, experts)}
