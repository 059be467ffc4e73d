"""Rollout routing replay (R3) on megatron-core's MoE routers.

The HF engines replay through a forward hook on transformers' routers
(:mod:`areal_cli.engines.routing_replay`); mcore's ``TopKRouter`` has its own seam for this:
``router.router_replay`` (``RouterReplay`` in ``megatron/core/transformer/moe/router_replay.py``, 0.16.1) is
asked for the top-k of every forward (``topk_routing_with_score_function`` calls
``get_replay_topk(scores, topk, num_groups, group_topk, compute)``). mcore's own class replays one tensor per
layer for the whole model, with no ``-1`` for tokens the server did not record, and keeps one process-global
list of routers (an actor and a reference model would share it). So each router gets a :class:`ReplayTopK`
instead, set per micro-batch by the engine:

- the chosen experts are the recorded ones where recorded (``-1``: the router's own choice); their scores are
  ``scores`` gathered at them, which mcore then turns into gate weights exactly as for its own choice
  (softmax over the chosen logits, or the pre-softmax probabilities), so the gate is still trained;
- the tokens are the ones this rank's router sees: the micro-batch's padded ``[B, L]`` rows sequence-first
  (mcore's ``[s, b, h]``), cut along ``s`` under sequence parallelism; the layers are this rank's pipeline
  chunks' layers, by their global ``layer_number``;
- training forwards (grad enabled) count, per (token, layer), where the router's own top-k differs from the
  replayed one: ``routing_replay/mismatch_rate``, as the HF engines report it.

Under full activation recompute mcore re-runs the router in the backward pass, after later micro-batches have
set theirs: refused (``areal_cli.engines.megatron.FULL_RECOMPUTE``).
"""

from __future__ import annotations

from typing import Any

import torch

from areal_cli.engines import routing_replay as r3


class ReplayTopK:
    """Stands in for mcore's ``RouterReplay`` on one router: the top-k of the next forwards."""

    def __init__(self, stats: torch.Tensor):
        self.target: torch.Tensor | None = None  # [tokens, top_k] expert ids, -1 where not recorded
        self.stats = stats  # shared by the model's routers: [differing (token, layer) pairs, replayed pairs]

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                        default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        vals, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        idx = self.target
        if idx is None:
            return vals, natural
        if idx.shape != natural.shape:
            raise r3.RoutingReplayError(f"{r3.KEY} gives {tuple(idx.shape)} expert ids for a router "
                                        f"forward of {tuple(natural.shape)}")
        idx = idx.to(natural.device, torch.long)
        have = (idx >= 0).all(dim=-1)
        chosen = torch.where(have[:, None], idx, natural)
        if torch.is_grad_enabled():  # a training forward (forward() runs without grad)
            with torch.no_grad():
                same = (natural.sort(dim=-1).values == idx.sort(dim=-1).values).all(dim=-1)
                self.stats += torch.stack([(have & ~same).sum(), have.sum()]).to(self.stats.device)
        return scores.gather(1, chosen), chosen


class ChunkRouting:
    """The routers of one rank's model chunks, each with a :class:`ReplayTopK`, in global layer order."""

    def __init__(self, chunks: list, n_layers: int, top_k: int, device: Any = None):
        # counted on the routers' device by every MoE layer's forward, read once per step (take_stats)
        self.stats = torch.zeros(2, dtype=torch.long, device=device)
        self.layers: list[tuple[int, ReplayTopK]] = []
        for c in chunks:
            for m in c.modules():
                router = getattr(getattr(m, "mlp", None), "router", None)
                if router is not None and hasattr(m, "layer_number"):
                    router.router_replay = ReplayTopK(self.stats)
                    self.layers.append((int(m.layer_number) - 1, router.router_replay))
        self.n_layers, self.top_k = n_layers, top_k

    def clear(self) -> None:
        """The next forwards route by the routers' own choice."""
        for _, rp in self.layers:
            rp.target = None

    def set(self, routing: torch.Tensor, rows: int, length: int, b: int, n: int,
            sp_rank: int = 0, sp_size: int = 1) -> None:
        """Route the next forwards by ``routing`` ``[b, n, n_layers * top_k]``.

        The forward's input is ``[rows, length]`` (the ``[b, n]`` micro-batch right-padded); its routers see
        ``length / sp_size`` positions of every row, sequence-first."""
        width = self.n_layers * self.top_k
        if routing.dim() != 3 or routing.shape[2] != width:
            raise r3.RoutingReplayError(f"{r3.KEY} has {tuple(routing.shape[2:])} ids per token; this "
                                        f"model has {self.n_layers} MoE layers with top_k={self.top_k} "
                                        f"({width} ids a token)")
        full = torch.full((length, rows, self.n_layers, self.top_k), r3.NO_ROUTE, dtype=torch.long)
        full[:n, :b] = routing[:b, :n].reshape(b, n, self.n_layers, self.top_k).transpose(0, 1).long()
        part = length // sp_size
        mine = full[sp_rank * part:(sp_rank + 1) * part].reshape(-1, self.n_layers, self.top_k)
        for layer, rp in self.layers:
            rp.target = mine[:, layer]

    def take_stats(self) -> torch.Tensor:
        """``[differing, replayed]`` (token, layer) pairs since the last call, as float64, then reset."""
        out = self.stats.to("cpu", torch.float64)  # the step's one host read of the counts
        self.stats.zero_()
        return out
