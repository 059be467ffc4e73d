"""Rollout routing replay (R3) for HF mixture-of-experts models.

The inference server records, for every token it feeds through the model, the experts each MoE layer's
router picked (``Capture``); the trainer then runs its forward with the same experts (``set_replay``):
each router still computes its logits from the trainer's weights, the chosen experts' gate weights are
that softmax gathered at the *recorded* indices (renormalised where the router renormalises its top-k),
so the gate scores of the chosen experts are differentiated as usual, and only the selection is fixed.
This is how verl's "R3" and slime's routing replay patch Megatron's top-k router (recorded indices
instead of ``topk``, probabilities gathered at them); here it is a forward hook on transformers'
``*TopKRouter`` modules, whose output is ``(router_logits, top_k_weights, top_k_indices)``.

Layout. A sequence's routing is an int16 tensor ``[L, n_moe_layers * top_k]`` aligned with its tokens
(layer-major within a token): entry ``i`` is the routing of token ``i`` when it was fed through the
model (it shapes the prediction of token ``i + 1``). The last token of a finished sequence is never fed,
padding neither: those entries are ``-1`` (``NO_ROUTE``), and a token marked ``-1`` keeps the trainer's
own choice. Batches carry it as ``routed_experts`` ``[B, L, n_moe_layers * top_k]``; the engine splits
the last dim by its model's layers and top-k. The wire format is SGLang's (``return_routed_experts`` →
``meta_info.routed_experts``: base64 of int32 ``[prompt + completion - 1, n_moe_layers, top_k]``).

Only routers that score with a softmax and take the top-k are known (:data:`SOFTMAX_ROUTERS`); the
first replayed forward of each router also checks that recomputing its own top-k from its logits
reproduces its output, so a router whose maths differ is refused, not silently mis-replayed.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

KEY = "routed_experts"
NO_ROUTE = -1
# transformers router classes whose output is (logits, top-k weights, top-k indices), weights = softmax
# over all experts gathered at the top-k, renormalised when ``norm_topk_prob`` (Mixtral: always).
SOFTMAX_ROUTERS = {"Qwen3MoeTopKRouter": None, "Qwen2MoeTopKRouter": None, "MixtralTopKRouter": True,
                   "Qwen3VLMoeTextTopKRouter": None, "OlmoeTopKRouter": None}


class RoutingReplayError(RuntimeError):
    """The recorded routing cannot be replayed on this model or batch."""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (module registration order)."""
    return [m for m in model.modules() if type(m).__name__ in SOFTMAX_ROUTERS]


def unknown_moe_reason(model: torch.nn.Module) -> str | None:
    """Why routing cannot be captured/replayed on ``model`` (None: it can)."""
    if routers(model):
        return None
    names = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Router")})
    if names:
        return f"its routers ({', '.join(names)}) are not softmax top-k routers this module knows"
    return "the model has no MoE layers"


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type that holds expert ids and ``-1`` (the server's buffers)."""
    return torch.int8 if num_experts <= 127 else torch.int16


WIRE_DTYPE = torch.int16  # the client's and the batch's: the client does not know the expert count


def _renormalises(router: torch.nn.Module) -> bool:
    fixed = SOFTMAX_ROUTERS.get(type(router).__name__)
    return bool(fixed) if fixed is not None else bool(getattr(router, "norm_topk_prob", False))


# ---------------------------------------------------------------------------------------------- capture
class Capture:
    """Records the indices each router returns, per forward, while :attr:`active` (server side)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise RoutingReplayError(f"cannot record routed experts: {unknown_moe_reason(model)}")
        self.top_k = int(self.routers[0].top_k)
        self.dtype = routing_dtype(int(self.routers[0].num_experts))
        self.active = False
        self._buf: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, _mod: torch.nn.Module, _args: Any, out: Any) -> None:
        if self.active:
            self._buf.append(out[2].detach())

    def take(self) -> torch.Tensor:
        """``[T, n_layers, top_k]`` of the last forward (``T`` = the tokens it fed, flattened), on CPU."""
        if len(self._buf) != len(self.routers):
            n = len(self._buf)
            self._buf = []
            raise RoutingReplayError(f"expected one routing per MoE layer ({len(self.routers)}), got {n}")
        out = torch.stack(self._buf, dim=1).to("cpu", self.dtype)
        self._buf = []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def encode(routing: torch.Tensor | list[torch.Tensor], start: int = 0) -> str:
    """SGLang's wire form: base64 of the int32 bytes (little-endian, C order) of ``routing[start:]``
    (a tensor, or chunks to concatenate along the token dim)."""
    if isinstance(routing, list):
        if not routing:
            return ""
        routing = torch.cat(routing)
    return base64.b64encode(routing[start:].to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode(text: str, n_tokens: int) -> torch.Tensor:
    """Inverse of :func:`encode`: ``[n_tokens, n_layers * top_k]`` int16 (layer-major per token).

    SGLang sends no shape: the row width follows from the byte count; the trainer's engine splits it
    into its model's ``(n_layers, top_k)`` and refuses a width that does not match."""
    import numpy as np

    raw = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    if n_tokens == 0:
        if raw.size:
            raise ValueError(f"routed_experts holds {raw.size} ids for 0 tokens")
        return torch.zeros((0, 0), dtype=WIRE_DTYPE)
    if raw.size % n_tokens or raw.size == 0:
        raise ValueError(f"routed_experts holds {raw.size} ids, not a positive multiple of {n_tokens} tokens")
    if raw.size and (raw.min() < NO_ROUTE or raw.max() > torch.iinfo(WIRE_DTYPE).max):
        raise ValueError(f"routed_experts has expert ids outside [-1, {torch.iinfo(WIRE_DTYPE).max}]")
    return torch.from_numpy(raw.astype(np.int16)).view(n_tokens, -1)


# ---------------------------------------------------------------------------------------------- replay
def set_replay(model: torch.nn.Module, routing: torch.Tensor | None) -> None:
    """Make the model's next forward (and the recomputation of that forward under activation
    checkpointing, which runs before the next call) use ``routing`` ``[T, n_layers, top_k]``, in the
    flattened token order the routers see (rows of ``[B, L]`` one after another; a packed ``[1, T]``).
    ``None`` restores the model's own routing. Hooks are installed on the first non-None call."""
    rs = getattr(model, "_areal_r3_routers", None)
    if routing is None:
        for r in rs or ():
            r._areal_r3 = None
        return
    if rs is None:
        rs = routers(model)
        if not rs:
            raise RoutingReplayError(f"the batch carries {KEY} but {unknown_moe_reason(model)}")
        for r in rs:
            r._areal_r3 = None
            r._areal_r3_checked = False
            r.register_forward_hook(_replay_hook)
        model._areal_r3_routers = rs
        # [differing tokens, replayed tokens], on the routers' device: counted there by every MoE layer's
        # forward and read once per step (a host copy per layer would stall the stream each time)
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        model._areal_r3_stats = torch.zeros(2, dtype=torch.long, device=dev)
    n_layers, top_k = len(rs), int(rs[0].top_k)
    if routing.dim() == 2 and routing.shape[1] == n_layers * top_k:
        routing = routing.view(routing.shape[0], n_layers, top_k)
    if routing.dim() != 3 or routing.shape[1] != n_layers or routing.shape[2] != top_k:
        raise RoutingReplayError(f"{KEY} has {tuple(routing.shape)[1:]} per token; this model has "
                                 f"{n_layers} MoE layers with top_k={top_k} ({n_layers * top_k} ids a token)")
    for i, r in enumerate(rs):
        r._areal_r3 = routing[:, i]
        r._areal_r3_stats = model._areal_r3_stats


MISMATCH = "routing_replay/mismatch_rate"


def replay_counts(model: torch.nn.Module) -> torch.Tensor | None:
    """``[differing, replayed]`` (token, MoE layer) pairs of training forwards since the last call, on
    the model's device (no host read), then reset; None when routing was never replayed."""
    st = getattr(model, "_areal_r3_stats", None)
    if st is None:
        return None
    out = st.clone()
    st.zero_()
    return out


def replay_stats(model: torch.nn.Module, reset: bool = True) -> dict[str, float]:
    """``routing_replay/mismatch_rate``: of the (token, MoE layer) pairs replayed by training forwards
    since the last reset, the fraction the trainer's own router would have sent to other experts (the
    train/inference routing mismatch that replay removes). Empty when nothing was replayed. Reads the
    counts on the host: the training loop takes :func:`replay_counts` instead and reads them per step."""
    st = getattr(model, "_areal_r3_stats", None)
    if st is None or int(st[1]) == 0:
        return {}
    diff, n = int(st[0]), int(st[1])
    if reset:
        st.zero_()
    return {MISMATCH: diff / n}


def _replay_hook(mod: torch.nn.Module, _args: Any, out: Any) -> Any:
    idx = getattr(mod, "_areal_r3", None)
    if idx is None:
        return None
    logits, scores, natural = out
    if idx.shape[0] != natural.shape[0]:
        raise RoutingReplayError(f"{KEY} covers {idx.shape[0]} tokens but the forward has {natural.shape[0]}")
    idx = idx.to(natural.device, torch.long)
    have = (idx >= 0).all(dim=-1)
    chosen = torch.where(have[:, None], idx, natural)
    probs = torch.softmax(logits.float(), dim=-1)
    if not mod._areal_r3_checked:  # the maths this hook assumes must rebuild the router's own output
        mine = probs.gather(1, natural)
        if _renormalises(mod):
            mine = mine / mine.sum(dim=-1, keepdim=True)
        if not torch.allclose(mine.to(scores.dtype).float(), scores.float(), rtol=1e-3, atol=1e-5):
            raise RoutingReplayError(f"{type(mod).__name__}'s weights are not a softmax top-k; cannot replay")
        mod._areal_r3_checked = True
    if mod.training:  # counted for training forwards (the step's stats), not for forward()
        with torch.no_grad():
            same = (natural.sort(dim=-1).values == idx.sort(dim=-1).values).all(dim=-1)
            st = mod._areal_r3_stats
            st += torch.stack([(have & ~same).sum(), have.sum()]).to(st.device)
    weights = probs.gather(1, chosen)
    if _renormalises(mod):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(scores.dtype), chosen


# ---------------------------------------------------------------------------------------------- layouts
def padded(mb: dict) -> torch.Tensor | None:
    """The padded forward's routing ``[B * L, n_layers, top_k]`` (None: the batch has none)."""
    r = mb.get(KEY)
    return None if r is None else r.reshape(-1, *r.shape[2:])


def packed(mb: dict, lengths: list[int], total: int, group: Any = None) -> torch.Tensor | None:
    """Routing of :func:`areal_cli.engines.packing.pack`'s row (real tokens of each row in order, then
    ``-1`` padding up to ``total``), this Ulysses rank's slice of it."""
    r = mb.get(KEY)
    if r is None:
        return None
    out = torch.full((total, *r.shape[2:]), NO_ROUTE, dtype=r.dtype)
    n_real = sum(lengths)
    if n_real:  # one gather and one host copy for the micro-batch, not one per row
        from areal_cli.engines.packing import row_prefix_index

        idx = row_prefix_index(lengths, r.shape[1], r.device)
        out[:n_real] = r.reshape(-1, *r.shape[2:]).index_select(0, idx).cpu()
    from areal_cli.engines import ulysses

    return ulysses.slice_for_rank(out, group, dim=0)


def _shared_sources(mb: dict) -> tuple[list[int], list[int]]:
    """(row, column) of every token of :func:`areal_cli.engines.packing.pack_shared`'s row: each prefix
    group's prefix from its first row, then every row's suffix (the same walk as ``pack_shared``)."""
    from areal_cli.engines import packing

    lens, first = packing.seq_lens(mb), packing.first_loss_index(mb)
    rows: list[int] = []
    cols: list[int] = []
    for g in packing.prefix_groups(mb, lens, first):
        f = min(first[g[0]], lens[g[0]])
        rows += [g[0]] * f
        cols += range(f)
        for r in g:
            rows += [r] * (lens[r] - f)
            cols += range(f, lens[r])
    return rows, cols


def shared(mb: dict, packed_ids: torch.Tensor) -> torch.Tensor | None:
    """Routing of :func:`areal_cli.engines.packing.pack_shared`'s row ``packed_ids`` ``[1, T]``."""
    r = mb.get(KEY)
    if r is None:
        return None
    rows, cols = _shared_sources(mb)
    ri, ci = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    if not torch.equal(mb["input_ids"][ri, ci].cpu(), packed_ids[0].cpu()):
        raise RoutingReplayError("routing replay: the shared-prefix layout changed (tokens do not line up)")
    return r.cpu()[ri, ci]


def prefix_shareable(mb: dict) -> bool:
    """Whether every prefix group's rows carry the same routing on their shared prefix (a group whose
    prompt was routed differently, e.g. by two policy versions, must be packed row by row)."""
    r = mb.get(KEY)
    if r is None:
        return True
    from areal_cli.engines import packing

    lens, first = packing.seq_lens(mb), packing.first_loss_index(mb)
    for g in packing.prefix_groups(mb, lens, first):
        f = min(first[g[0]], lens[g[0]])
        head = r[g[0], :f]
        if any(not torch.equal(r[x, :f], head) for x in g[1:]):
            return False
    return True


# ---------------------------------------------------------------------------------------------- rows
def stitch(have: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """A sequence's routing so far ``[n, ...]`` extended by a later response's ``new`` ``[m, ...]``
    covering positions ``0..m-1``: positions already recorded keep their first recording (the routing
    the tokens generated right after them were sampled under), later ones come from ``new``."""
    if have is None or have.shape[0] == 0:
        return new
    if new.shape[0] <= have.shape[0]:
        return have
    if new.shape[1:] != have.shape[1:]:
        raise RoutingReplayError(f"routing shapes differ between segments: {tuple(have.shape[1:])} vs "
                                 f"{tuple(new.shape[1:])}")
    return torch.cat([have, new[have.shape[0]:].to(have.dtype)])


def row_routing(routing: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, n_layers, top_k]``: ``routing`` (positions ``0..n-1``, ``n <= length``) then ``-1``."""
    if routing.shape[0] > length:
        raise RoutingReplayError(f"routing covers {routing.shape[0]} tokens of a {length}-token sequence")
    out = torch.full((length, *routing.shape[1:]), NO_ROUTE, dtype=routing.dtype)
    out[: routing.shape[0]] = routing
    return out
