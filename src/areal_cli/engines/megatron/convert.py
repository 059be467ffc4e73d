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
- Per layer, from the parameters the built layer has: where its two norms live (the local spec's own norm
  modules, or TE's spec's fused ``layer_norm_weight`` of ``linear_qkv`` and of a dense ``linear_fc1``, with a
  separate ``pre_mlp_layernorm`` in front of an MoE block) and whether its MLP is MoE (a router).
- Loading reads through a :class:`TensorSource`: a rank reads only the tensors its chunks own (its stage's
  layers, its ep rank's experts), column-parallel ones as their dim-0 slices, and converts a layer at a time.
  Export (:func:`hf_tensors`) gathers one tensor, or one expert's tensor, at a time over TP (expert TP) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .model import HFArch

_EMB = "embedding.word_embeddings.weight"
_OUT = "output_layer.weight"
_NORM = "decoder.final_layernorm.weight"
# a critic's value head (engine.py's ValueHead) replaces the output layer: HF keeps it as lm_head.{weight,bias}
_VALUE = ("output_layer.head.weight", "output_layer.head.bias")


# Where a layer's two norms live. The local spec keeps them as modules of their own; TE's spec fuses each into
# the linear that follows it (TELayerNormColumnParallelLinear's ``layer_norm_weight``) where that linear is one
# TE module: always the qkv projection, but only a dense MLP's fc1. An MoE block has no such linear in front, so
# TE's spec gives MoE layers a separate ``pre_mlp_layernorm`` (gpt_layer_specs.py: ``pre_mlp_layernorm=
# backend.layer_norm() if num_experts else IdentityOp``), and a model with dense and MoE layers (first-k-dense)
# holds both forms: the names are read per layer, from the parameters the built layer actually has.
_IN_NORMS = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
_MLP_NORMS = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_ROUTER = "mlp.router.weight"


class _LayerNames(NamedTuple):
    """One decoder layer's parameter names (relative to the layer) that differ between specs and layers."""

    in_norm: str
    mlp_norm: str
    moe: bool


def _layer_names(layer: Any, arch: HFArch) -> _LayerNames:
    names = {n for n, _ in layer.named_parameters()}

    def one(options: tuple[str, ...], what: str) -> str:
        found = [o for o in options if o in names]
        if len(found) != 1:  # none: a spec this converter does not know; two: a norm HF has no place for
            raise RuntimeError(f"HF <-> mcore conversion: layer {layer.layer_number} has {found or 'none'} of "
                               f"the {what} names {list(options)}, expected exactly one")
        return found[0]

    has_qk = [n in names for n in _QK_NORMS]
    if has_qk != [arch.qk_norm] * 2:
        raise RuntimeError(f"HF <-> mcore conversion: layer {layer.layer_number} q/k norms {has_qk}, but the HF "
                           f"model {'has' if arch.qk_norm else 'has no'} q_norm/k_norm")
    return _LayerNames(one(_IN_NORMS, "input norm"), one(_MLP_NORMS, "pre-MLP norm"), _ROUTER in names)


def _layer_map(model: Any, arch: HFArch) -> list[tuple[int, int, _LayerNames]]:
    """(local index j, global HF layer index, the layer's names) for every layer of this chunk."""
    return [(j, int(layer.layer_number) - 1, _layer_names(layer, arch))
            for j, layer in enumerate(model.decoder.layers)]


def _qkv(groups: int, q: Any, k: Any, v: Any) -> Any:
    """Interleave q/k/v per query group: [q_g; k_g; v_g] for g in ``groups`` (weights or biases). A TP rank's
    dim-0 chunk of the full layout is this interleave of its own q/k/v chunks (it holds whole groups)."""
    import torch

    tail = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)],
                     1).reshape(-1, *tail)


def _split_qkv(arch: HFArch, qkv: Any) -> tuple[Any, Any, Any]:
    g, hd = arch.num_kv_heads, arch.head_dim
    per_q = arch.num_heads // g * hd
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, per_q + 2 * hd, *tail).split([per_q, hd, hd], 1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


class TensorSource:
    """Where :func:`load_hf` reads HF tensors, by HF name: ``get(name)`` (the whole tensor) or
    ``get_chunk(name, dim, index, parts)`` (``torch.chunk(t, parts, dim)[index]``), each a fresh tensor.

    ``base`` is an :class:`~areal_cli.weight_sync.hf_io.HFCheckpoint` (a dim-0 chunk reads only its bytes, so a
    rank never reads what its chunks do not hold) or an in-memory Mapping of full tensors (tests, small models).
    ``extra`` tensors are looked up first (a critic's value head, which lives outside the safetensors).
    ``dtype``: floating tensors are cast to it as read, as HF's ``from_pretrained(dtype=...)`` did before the
    engine read checkpoints itself (one rounding, so the loaded parameters are the same bits)."""

    def __init__(self, base: Any, extra: Mapping[str, Any] | None = None, dtype: Any = None):
        self.base, self.extra, self.dtype = base, dict(extra or {}), dtype
        self._lazy = hasattr(base, "get_chunk")

    def __contains__(self, name: str) -> bool:
        return name in self.extra or name in self.base

    def _cast(self, t: Any) -> Any:
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def get(self, name: str) -> Any:
        if self._lazy and name not in self.extra:
            return self._cast(self.base.get(name))
        return self._cast((self.extra.get(name) if name in self.extra else self.base[name]).detach().clone())

    def get_chunk(self, name: str, dim: int, index: int, parts: int) -> Any:
        if self._lazy and name not in self.extra:
            return self._cast(self.base.get_chunk(name, dim, index, parts))
        t = self.extra.get(name) if name in self.extra else self.base[name]
        return self._cast(t.detach().chunk(parts, dim)[index].clone())


def _mcore_groups(src: TensorSource, arch: HFArch, model: Any, tp_rank: int, tp: int,
                  experts: ExpertLayout | None = None) -> Iterator[dict[str, Any]]:
    """This chunk's mcore tensors on TP rank ``tp_rank`` (and, for MoE, expert-parallel rank ``experts.ep_rank``),
    one group at a time (the embedding and head, then one layer): only the tensors the chunk owns are read, and
    column-parallel ones as their dim-0 chunks."""
    import torch

    def col(name: str) -> Any:
        return src.get_chunk(name, 0, tp_rank, tp)

    def row(name: str) -> Any:
        return src.get_chunk(name, 1, tp_rank, tp)

    ends: dict[str, Any] = {}
    if model.pre_process:
        ends[_EMB] = col("model.embed_tokens.weight")
    if model.post_process:
        ends[_NORM] = src.get("model.norm.weight")
        if _VALUE[0] in model.state_dict():  # replicated on every TP rank, like the final norm
            ends[_VALUE[0]], ends[_VALUE[1]] = src.get("lm_head.weight"), src.get("lm_head.bias")
        # one stage with tied weights: output_layer is the embedding itself; under PP the last stage's copy
        # is loaded from the embedding
        elif not (arch.tied and model.pre_process):
            ends[_OUT] = col("model.embed_tokens.weight" if arch.tied else "lm_head.weight")
    yield ends
    groups = arch.num_kv_heads // tp
    for j, i, names in _layer_map(model, arch):
        p, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        a = p + "self_attn."
        out: dict[str, Any] = {}
        for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
            out[m + f"self_attention.linear_qkv.{kind}"] = _qkv(
                groups, col(f"{a}q_proj.{kind}"), col(f"{a}k_proj.{kind}"), col(f"{a}v_proj.{kind}"))
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = src.get(a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = src.get(a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = row(a + "o_proj.weight")
        if names.moe:
            out.update(_experts_to_mcore(src, arch, p, m, experts or ExpertLayout()))
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([col(p + "mlp.gate_proj.weight"),
                                                          col(p + "mlp.up_proj.weight")], 0)
            out[m + "mlp.linear_fc2.weight"] = row(p + "mlp.down_proj.weight")
        out[m + names.in_norm] = src.get(p + "input_layernorm.weight")
        out[m + names.mlp_norm] = src.get(p + "post_attention_layernorm.weight")
        yield out


def mcore_groups(hf: TensorSource, arch: HFArch, model: Any, tp_rank: int, tp: int,
                 experts: ExpertLayout | None = None) -> Iterator[dict[str, Any]]:
    """One GPTModel chunk's state dict on TP rank ``tp_rank``, a layer's group at a time."""
    yield from _mcore_groups(hf, arch, model, tp_rank, tp, experts)


def hf_to_mcore(hf: Mapping[str, Any] | TensorSource, arch: HFArch, model: Any, tp_rank: int, tp: int,
                experts: ExpertLayout | None = None) -> dict[str, Any]:
    """The state dict of one GPTModel chunk on TP rank ``tp_rank`` from a full HF state dict or a
    :class:`TensorSource`, as one dict (:func:`load_hf` streams it a layer at a time instead)."""
    src = hf if isinstance(hf, TensorSource) else TensorSource(hf)
    out: dict[str, Any] = {}
    for group in _mcore_groups(src, arch, model, tp_rank, tp, experts):
        out.update(group)
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


def _experts_to_mcore(src: TensorSource, arch: HFArch, p: str, m: str, x: ExpertLayout) -> dict[str, Any]:
    """The router (``gate.weight [E, H]``) and this rank's SequentialMLP experts, read expert by expert: only the
    experts of this ep rank, and of each only this etp rank's slices."""
    import torch

    out = {m + "mlp.router.weight": src.get(p + "mlp.gate.weight")}
    n = arch.num_experts // x.ep
    for j in range(n):
        gate, up, down = _hf_expert(src, arch, p, x.ep_rank * n + j, x)
        q = f"{m}mlp.experts.local_experts.{j}."
        out[q + "linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[q + "linear_fc2.weight"] = down
    return out


def _hf_expert(src: TensorSource, arch: HFArch, p: str, e: int, x: ExpertLayout) -> tuple[Any, Any, Any]:
    """This etp rank's (gate [I/etp, H], up [I/etp, H], down [H, I/etp]) of expert e: from a checkpoint's
    per-expert tensors (the format transformers writes and vLLM/SGLang load) or from fused ones
    (``gate_up_proj [E, 2I, H]`` = [gate; up] per expert, ``down_proj [E, H, I]``: transformers' in-memory form)."""
    fused = p + "mlp.experts.gate_up_proj"
    if fused in src:
        gate, up = src.get_chunk(fused, 0, e, arch.num_experts)[0].chunk(2, 0)
        down = src.get_chunk(p + "mlp.experts.down_proj", 0, e, arch.num_experts)[0]
        return (gate.chunk(x.etp, 0)[x.etp_rank], up.chunk(x.etp, 0)[x.etp_rank],
                down.chunk(x.etp, 1)[x.etp_rank].clone())
    q = f"{p}mlp.experts.{e}."
    return (src.get_chunk(q + "gate_proj.weight", 0, x.etp_rank, x.etp),
            src.get_chunk(q + "up_proj.weight", 0, x.etp_rank, x.etp),
            src.get_chunk(q + "down_proj.weight", 1, x.etp_rank, x.etp))


def load_hf(models: Iterable[Any], hf: Mapping[str, Any] | TensorSource, arch: HFArch, tp_rank: int, tp: int,
            experts: ExpertLayout | None = None) -> None:
    """Load HF weights (a full state dict, or a :class:`TensorSource` over a checkpoint) into this rank's chunks,
    a layer at a time (so at most one layer's converted tensors are held beside the chunks); every mcore
    parameter must be covered."""
    src = hf if isinstance(hf, TensorSource) else TensorSource(hf)
    for model in models:
        want = set(model.state_dict().keys())
        covered: set[str] = set()
        unexpected: list[str] = []
        for group in _mcore_groups(src, arch, model, tp_rank, tp, experts):
            # mcore's load hooks (default _extra_state, rotary inv_freq, router dtype) run per call: harmless
            res = model.load_state_dict(group, strict=False)
            unexpected += res.unexpected_keys
            covered |= group.keys()
        missing = sorted(k for k in want - covered if not k.endswith("_extra_state"))
        if missing or unexpected:
            raise RuntimeError(f"HF -> mcore conversion mismatch: missing {missing}, unexpected {unexpected}")


def _gather(t: Any, dim: int, group: Any, tp: int) -> Any:
    import torch

    from areal_cli.utils import collectives

    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    collectives.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


class HFPart(NamedTuple):
    """One HF tensor of :func:`hf_tensors`. ``fn()`` returns the full tensor; it is a collective over the TP group
    (dense tensors: every TP rank of the stage calls it) or, for an expert (``expert_owner`` = the ep rank that
    holds it), over the expert-TP group, called only by that ep rank's ranks."""

    name: str
    fn: Callable[[], Any]
    expert_owner: int | None = None


def hf_tensors(models: Iterable[Any], arch: HFArch, tp_group: Any, tp: int,
               experts: ExpertLayout | None = None) -> list[HFPart]:
    """An :class:`HFPart` for every HF tensor this rank's stage owns, in a fixed order (the same on every rank
    of the stage). Calling a part gathers that one tensor, so an exporter holds one full tensor at a time; the
    collectives involve only the TP (or expert-TP) group, so a data-parallel replica that does not export skips
    the calls entirely. Each PP stage lists only its own layers; the union over stages is the full HF dict."""
    out: list[HFPart] = []

    def add(name: str, fn: Callable[[], Any], owner: int | None = None) -> None:
        out.append(HFPart(name, fn, owner))

    for model in models:
        sd = model.state_dict()

        def gathered(key: str, dim: int, sd=sd) -> Callable[[], Any]:
            return lambda: _gather(sd[key], dim, tp_group, tp)

        def copied(key: str, sd=sd) -> Callable[[], Any]:
            return lambda: sd[key].detach().clone()

        if model.pre_process:
            add("model.embed_tokens.weight", gathered(_EMB, 0))
        for j, i, names in _layer_map(model, arch):
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
            if names.moe:
                add(p + "mlp.gate.weight", copied(m + "mlp.router.weight"))
                for name, fn, owner in _expert_parts(sd, m, experts or ExpertLayout(), arch):
                    add(p + name, fn, owner)
            else:
                fc1 = sd[m + "mlp.linear_fc1.weight"]  # this rank's [gate_shard; up_shard]
                add(p + "mlp.gate_proj.weight", lambda t=fc1: _gather(t.chunk(2, 0)[0], 0, tp_group, tp))
                add(p + "mlp.up_proj.weight", lambda t=fc1: _gather(t.chunk(2, 0)[1], 0, tp_group, tp))
                add(p + "mlp.down_proj.weight", gathered(m + "mlp.linear_fc2.weight", 1))
            add(p + "input_layernorm.weight", copied(m + names.in_norm))
            add(p + "post_attention_layernorm.weight", copied(m + names.mlp_norm))
        if model.post_process:
            add("model.norm.weight", copied(_NORM))
            if _VALUE[0] in sd:
                add("lm_head.weight", copied(_VALUE[0]))
                add("lm_head.bias", copied(_VALUE[1]))
            elif not arch.tied:
                add("lm_head.weight", gathered(_OUT, 0))
    return out


def _expert_parts(sd: Mapping[str, Any], m: str, x: ExpertLayout, arch: HFArch) -> list[HFPart]:
    """Per-expert HF tensors (``experts.{e}.{gate,up,down}_proj.weight``, the checkpoint format) of one layer,
    one expert at a time: expert e lives on ep rank ``e // (E/ep)`` as local expert ``e % (E/ep)``; its
    thunks gather it over etp only, so no rank ever holds another rank's experts."""
    n = arch.num_experts // x.ep
    out = []
    for e in range(arch.num_experts):
        q = f"{m}mlp.experts.local_experts.{e % n}."
        fc1, fc2 = q + "linear_fc1.weight", q + "linear_fc2.weight"  # fc1: this rank's [gate_shard; up_shard]
        for k, fn in (("gate_proj", lambda k=fc1: _gather(sd[k].chunk(2, 0)[0], 0, x.etp_group, x.etp)),
                      ("up_proj", lambda k=fc1: _gather(sd[k].chunk(2, 0)[1], 0, x.etp_group, x.etp)),
                      ("down_proj", lambda k=fc2: _gather(sd[k], 1, x.etp_group, x.etp))):
            out.append(HFPart(f"mlp.experts.{e}.{k}.weight", fn, e // n))
    return out


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
    calls it), as one dict: the dense ones and this ep rank's experts; see :func:`hf_tensors`."""
    ep_rank = (experts or ExpertLayout()).ep_rank
    return {p.name: p.fn() for p in hf_tensors(models, arch, tp_group, tp, experts)
            if p.expert_owner is None or p.expert_owner == ep_rank}
