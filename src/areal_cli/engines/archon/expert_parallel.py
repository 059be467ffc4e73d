"""Expert parallelism for Archon: an MoE block whose experts are cut over the ``ep`` ranks, with token
dispatch and combine through ``all_to_all_single`` (torchtitan's ``expert_parallel.py``, on HF modules).

Each decoder layer's HF sparse-MoE block (``mlp``: the router ``gate`` and the fused ``experts`` with
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) is replaced by :class:`MoEBlock`, which keeps the
same two submodules, so parameter names stay HF names. Under ``e > 1`` the expert tensors become DTensors
``Shard(0)`` over the ``ep`` mesh (rank ``r`` holds experts ``r·E/e … (r+1)·E/e − 1``); FSDP2 then shards
them once more over the ``efsdp`` ranks (``d×c / e``), as torchtitan does.

A forward: route every token (:meth:`MoEBlock._route`, one place a forced routing can be plugged in
later), order the ``T·k`` (token, expert) assignments by expert, exchange the per-expert counts, send
each rank the rows of its experts (uneven splits, autograd through the all-to-all), run every local
expert on its contiguous rows, send the rows back, weight them and sum over the ``k`` choices. No token
is dropped (no capacity factor): the numbers equal transformers' own loop over the experts.

The router's load-balancing loss (Switch/mcore form, ``E · Σ_i P_i · f_i``: ``P_i`` the mean router
probability of expert ``i``, ``f_i`` its share of the ``T·k`` assignments; 1.0 when the experts are used
evenly) is added to the gradients by :class:`_AuxLossScaler` with the weight the engine sets per
micro-batch, and recorded (once per micro-batch, in backward) for the step's stats.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from areal_cli.utils import collectives

MOE_BLOCK_CLASSES = ("Qwen3MoeSparseMoeBlock",)
SUPPORTED = "Qwen3-MoE (qwen3_moe)"


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] combine weights of the chosen experts
    indices: torch.Tensor  # [T, k] expert ids
    logits: torch.Tensor  # [T, E] router logits (for the load-balancing loss)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward sends the gradients back the
    reverse way (splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        collectives.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        collectives.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _AuxLossScaler(torch.autograd.Function):
    """Identity on ``out``; in backward, ``scale`` is the gradient of ``aux`` (mcore's MoEAuxLossAutoScaler):
    the loss joins the graph without changing the main loss value. ``record`` gets ``aux`` once per
    backward (activation-checkpoint recompute runs forward twice but backward once)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float, record):
        ctx.scale, ctx.record = scale, record
        ctx.save_for_backward(aux.detach())
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        if ctx.record is not None:
            ctx.record(aux)
        return grad, torch.full_like(aux, ctx.scale), None, None


def load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E · Σ_i P_i · f_i`` over these tokens (a differentiable scalar through ``P``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts).to(probs.dtype)
    frac = counts / max(1, indices.numel())
    return num_experts * (probs.mean(0) * frac).sum()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class LocalExperts(nn.Module):
    """This rank's experts (transformers' fused tensors, the same parameter names), called on rows already
    grouped by expert. A module call of its own, so FSDP2 gathers the expert shards around it."""

    def __init__(self, hf_experts: nn.Module):
        super().__init__()
        self.gate_up_proj = hf_experts.gate_up_proj  # [E_local, 2I, H]
        self.down_proj = hf_experts.down_proj  # [E_local, H, I]
        self.act_fn = hf_experts.act_fn

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Local expert ``j`` on rows ``sum(counts[:j]) … sum(counts[:j+1])`` (transformers' math)."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        outs = []
        for j, chunk in enumerate(rows.split(counts, dim=0)):
            if chunk.shape[0] == 0:
                continue
            gate, up = nn.functional.linear(chunk, gate_up[j]).chunk(2, dim=-1)
            outs.append(nn.functional.linear(self.act_fn(gate) * up, down[j]))
        if not outs:  # no rows here: keep the expert weights in the graph (zero gradient)
            return rows.new_zeros((0, rows.shape[-1])) + 0.0 * (gate_up.sum() + down.sum())
        return torch.cat(outs, dim=0)


class MoEBlock(nn.Module):
    """A Qwen3-MoE sparse block with expert-parallel dispatch (``ep_group`` None: all experts local)."""

    def __init__(self, hf_block: nn.Module, num_experts: int, top_k: int, ep_group: Any = None):
        super().__init__()
        self.gate = hf_block.gate
        self.experts = LocalExperts(hf_block.experts)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.local_experts = self.num_experts // self.ep_size
        # set by the engine per micro-batch: the load-balancing loss's weight (0: off) and its recorder
        self.aux_scale = 0.0
        self.aux_record = None

    # ---- routing: the one place a forced routing (given expert ids per token) plugs in
    def _route(self, hidden: torch.Tensor) -> Routing:
        logits, weights, indices = self.gate(hidden)
        return Routing(weights, indices, logits)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        r = self._route(x)
        out = self._dispatch_compute_combine(x, r.weights, r.indices)
        if self.aux_scale > 0 and torch.is_grad_enabled() and self.training:
            aux = load_balancing_loss(r.logits, r.indices, self.num_experts)
            out = _AuxLossScaler.apply(out, aux, float(self.aux_scale), self.aux_record)
        return out.reshape(shape)

    def _dispatch_compute_combine(self, x: torch.Tensor, weights: torch.Tensor,
                                  indices: torch.Tensor) -> torch.Tensor:
        T, k = indices.shape
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = x.index_select(0, token_of)
        if self.ep_size == 1:
            y = self.experts(rows, counts.tolist())
        else:
            y = self._exchange_and_run(rows, counts)
        y = y * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add(0, token_of, y.to(x.dtype))

    def _exchange_and_run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each rank the rows of its experts, run them, send the results back (same order)."""
        ep, n_local = self.ep_size, self.local_experts
        send = counts.view(ep, n_local)  # [dest rank, its local expert]
        recv = torch.empty_like(send)
        # recv: [src rank, my local expert]
        collectives.all_to_all_single(recv, send.contiguous(), group=self.ep_group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all(rows, out_splits, in_splits, self.ep_group)  # ordered by (src rank, local expert)
        expert_of = torch.repeat_interleave(torch.arange(n_local, device=rows.device).repeat(ep),
                                            recv.reshape(-1).to(rows.device))
        perm = torch.argsort(expert_of, stable=True)  # → ordered by (local expert, src rank)
        y = self.experts(got.index_select(0, perm), recv.sum(0).tolist())
        back = torch.empty_like(y).index_copy(0, perm, y)  # undo the permutation (differentiable)
        return all_to_all(back, in_splits, out_splits, self.ep_group)

def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def is_moe_config(hf_config: Any) -> bool:
    return int(getattr(hf_config, "num_experts", 0) or 0) > 0


def apply_moe(model: nn.Module, hf_config: Any, ep_mesh: Any = None) -> list[MoEBlock]:
    """Swap every HF sparse-MoE block for :class:`MoEBlock`; with ``ep_mesh`` (1-D, size ``e``) cut the
    experts over it as ``Shard(0)`` DTensors (no communication: every rank holds the full model)."""
    from torch.distributed.tensor import DTensor, Shard

    E, k = int(hf_config.num_experts), int(hf_config.num_experts_per_tok)
    group = ep_mesh.get_group() if ep_mesh is not None and ep_mesh.size() > 1 else None
    blocks = []
    for layer in getattr(getattr(model, "model", None), "layers", []):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or type(mlp).__name__ not in MOE_BLOCK_CLASSES:
            continue
        block = MoEBlock(mlp, E, k, group)
        if group is not None:
            n, r = block.local_experts, block.ep_rank
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(block.experts, name)
                local = full.detach()[r * n:(r + 1) * n].clone()
                dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
                setattr(block.experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        layer.mlp = block
        blocks.append(block)
    return blocks


def per_expert_names(name: str, t: torch.Tensor | None, expert: int | None = None):
    """A fused expert tensor as the checkpoint's per-expert ``(name, tensor)`` pairs (views). With
    ``expert``, ``t`` is that one expert's slice (``None`` on ranks that do not hold it)."""
    if expert is not None:
        base = name[: -len("gate_up_proj")] if name.endswith("gate_up_proj") else name[: -len("down_proj")]
        if name.endswith(".experts.gate_up_proj"):
            gate, up = (None, None) if t is None else t.chunk(2, dim=0)
            yield f"{base}{expert}.gate_proj.weight", gate
            yield f"{base}{expert}.up_proj.weight", up
        else:
            yield f"{base}{expert}.down_proj.weight", t
        return
    if name.endswith(".experts.gate_up_proj"):
        base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{base}{e}.gate_proj.weight", t[e, :inter]
            yield f"{base}{e}.up_proj.weight", t[e, inter:]
    elif name.endswith(".experts.down_proj"):
        base = name[: -len("down_proj")]
        for e in range(t.shape[0]):
            yield f"{base}{e}.down_proj.weight", t[e]
    else:
        yield name, t


def fuse_experts(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight`` …) as transformers' fused
    in-memory ones (``experts.gate_up_proj``, ``experts.down_proj``); other tensors unchanged."""
    import re

    pat = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in full.items():
        m = pat.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
    for base, experts in groups.items():
        ids = sorted(experts)
        out[base + "gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                  for e in ids])
        out[base + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out
