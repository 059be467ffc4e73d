"""The AdamW state of a tied table that two pipeline stages both hold, split between them by rows.

Under pipelining the first stage looks tokens up in the embedding and the last computes the head with its
own copy of it (``pipeline.StageModule.tied_copy``); after backward both copies carry the summed gradient
(``Pipeline.sync_tied_grads``) and took identical AdamW steps, each with its own two moments: on a
Qwen2.5-0.5B shape at t2p2 the table's moments were 0.51 GiB on each of the four ranks, and the last stage
peaked 0.13 GiB over the state bound (docs/training.md). Here each copy's holder keeps the moments of half of
its local rows (the first stage the first half, the last stage the rest), steps those rows, and the two
exchange the stepped halves over the embedding group, so both copies stay equal.

The main optimizer leaves the table out (the engine builds it without it, and zeroes its gradient with
the others: ``_zero_grad``). A step post-hook on it steps the owned rows with a ``torch.optim.AdamW`` of the
same implementation and hyper-parameters (read from the main optimizer's group at each step, so the
schedule's learning rate applies), then exchanges the rows. The update is elementwise, so each row's new
value is bit for bit what the whole-table step gave. The moments travel in the engine's per-rank checkpoint
file (``state_dict``), beside DCP's state of the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from areal_cli.utils import collectives
from areal_cli.utils.optim import adamw_like, follow


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class TiedRows:
    """``param``: this rank's copy of the table (the first stage's embedding or the last stage's head);
    ``group``: the embedding group, the first stage's rank first; ``first``: which end this rank is."""

    def __init__(self, param: torch.nn.Parameter, group: Any, first: bool):
        import torch.distributed as dist

        self.param, self.group, self.first = param, group, first
        rows = _local(param).shape[0]
        half = (rows + 1) // 2
        self.spans = ((0, half), (half, rows))  # the first stage's rows, the last stage's
        self.lo, self.hi = self.spans[0 if first else 1]
        n = dist.get_world_size(group)
        self.srcs = (dist.get_global_rank(group, 0), dist.get_global_rank(group, n - 1))
        self.opt: torch.optim.AdamW | None = None

    @property
    def rows(self) -> torch.Tensor:
        """The owned rows of the local copy: a view, so stepping it steps the copy."""
        return _local(self.param).detach()[self.lo:self.hi]

    def attach(self, main: torch.optim.Optimizer) -> None:
        main.register_step_pre_hook(self._before)
        main.register_step_post_hook(self._after)

    def _before(self, main, args, kwargs) -> None:
        if not main.state:  # the first step, or warm_up dropped the moments: these start afresh with them
            self.opt = None

    @torch.no_grad()
    def _after(self, main, args, kwargs) -> None:
        grad, self.param.grad = self.param.grad, None
        if grad is None:
            return
        group = main.param_groups[0]
        if self.opt is None:
            self.opt = adamw_like([self.rows], group)
        follow(self.opt, group)  # the schedule's lr for this step
        view = self.opt.param_groups[0]["params"][0]
        view.grad = _local(grad)[self.lo:self.hi]
        self.opt.step()
        view.grad = None
        local = _local(self.param).detach()
        for (lo, hi), src in zip(self.spans, self.srcs, strict=True):
            if hi > lo:
                collectives.broadcast(local[lo:hi], src=src, group=self.group)

    # ---- checkpoints (the engine's per-rank file)
    def state_dict(self) -> dict | None:
        if self.opt is None:
            return None
        return dict(self.opt.state[self.opt.param_groups[0]["params"][0]])  # torch.save writes it at once

    def load_state_dict(self, state: dict | None, main: torch.optim.Optimizer) -> None:
        self.opt = None
        if state is not None:
            self.opt = adamw_like([self.rows], main.param_groups[0])
            self.opt.state[self.opt.param_groups[0]["params"][0]] = dict(state)
