"""A training step's loss and stats, kept as tensors until the step ends.

Reading a device scalar on the host (``float(t)``, ``t.item()``, ``t.cpu()``) waits for every kernel queued
before it: once per micro-batch, that stalls the GPU stream between micro-batches (the next forward can
only be queued after the previous backward has finished). :class:`StepStats` records the per-micro-batch
values as they are and reads them all with one copy per device in :meth:`StepStats.totals`.

The sums are taken on the host, in micro-batch order, from the same float64 values ``float(t)`` would
have given, so they are bit-identical to summing ``float(t)`` as each micro-batch ends.
"""

from __future__ import annotations

from typing import Any

import torch

_VALUE, _RATIO = 0, 1


class StepStats:
    """Scaled micro-batch losses and ``(stat, weight)`` pairs, read once (:meth:`totals`)."""

    def __init__(self) -> None:
        self._losses: list[Any] = []
        self._entries: list[tuple[int, str, Any, float]] = []

    @classmethod
    def of(cls, losses, stats: dict[int, dict[str, Any]], weights) -> StepStats:
        """From a schedule's records: the scaled losses in order, ``stats[i]`` of micro-batch ``i``."""
        acc = cls()
        for t in losses:
            acc.add_loss(t)
        for i, st in stats.items():
            acc.add(st, weights[i])
        return acc

    def add_loss(self, scaled: Any) -> None:
        """A micro-batch's loss already scaled by ``weight / global_weight`` (a tensor or a number)."""
        self._losses.append(scaled.detach() if isinstance(scaled, torch.Tensor) else scaled)

    def add(self, stats: dict[str, Any], weight: float) -> None:
        """A micro-batch's stats (scalar tensors or numbers), each to be summed times ``weight``."""
        for k, v in stats.items():
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:  # what float(v) would refuse
                    raise ValueError(f"stat {k!r} has {v.numel()} elements; a stat is one number")
                v = v.detach()
            self._entries.append((_VALUE, k, v, weight))

    def add_ratio(self, key: str, counts: torch.Tensor | None, weight: float) -> None:
        """``weight · counts[0] / counts[1]`` under ``key`` when ``counts[1] > 0`` (else nothing: the key
        is absent from the totals unless some micro-batch had a non-zero denominator)."""
        if counts is not None:
            self._entries.append((_RATIO, key, counts, weight))

    def totals(self) -> tuple[float, dict[str, float]]:
        """``(loss sum, {stat: weighted sum})``: one host read per device the values live on."""
        tensors = [x for x in self._losses if isinstance(x, torch.Tensor)]
        tensors += [e[2] for e in self._entries if isinstance(e[2], torch.Tensor)]
        host = read_floats(tensors)
        loss_sum = 0.0
        for x in self._losses:
            loss_sum += host[id(x)] if isinstance(x, torch.Tensor) else float(x)
        sums: dict[str, float] = {}
        for kind, k, v, w in self._entries:
            if kind == _RATIO:
                diff, n = host[id(v)]
                if n > 0:
                    sums[k] = sums.get(k, 0.0) + diff / n * w
            else:
                sums[k] = sums.get(k, 0.0) + (host[id(v)] if isinstance(v, torch.Tensor) else float(v)) * w
        return loss_sum, sums


def read_floats(tensors: list[torch.Tensor]) -> dict[int, Any]:
    """``id(t)`` → ``float(t)`` (a list of floats for a multi-element ``t``), one ``tolist`` per device."""
    by_dev: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_dev.setdefault(t.device, []).append(t)
    out: dict[int, Any] = {}
    for ts in by_dev.values():
        sizes = [t.numel() for t in ts]
        # float64 holds every float32/bf16/int value exactly: the same numbers float(t) gives
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in ts]).tolist()
        pos = 0
        for t, n in zip(ts, sizes):
            out[id(t)] = flat[pos] if t.dim() == 0 or n == 1 else flat[pos:pos + n]
            pos += n
    return out
