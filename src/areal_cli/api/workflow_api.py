"""The rollout-workflow contract and the trajectory container it returns."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from areal_cli.api.inference_api import InferenceEngine


@dataclass
class Trajectory:
    """A batch of sequences as one dict of tensors with a leading batch dim.

    Required keys: ``input_ids`` [B, L], ``attention_mask`` [B, L], ``loss_mask`` [B, L],
    ``logprobs`` [B, L], ``versions`` [B, L] (-1 on prompt tokens), ``rewards`` [B].
    Workflows may add more (e.g. ``seq_no_eos_mask``, ``group_id``). Per-token tensors follow the
    position convention in :mod:`areal_cli.api.engine_api`.
    """

    data: "dict[str, torch.Tensor]"
    meta: dict[str, Any] = field(default_factory=dict)
    # The prompt-stream position of each episode in this batch (one per episode, None where unknown): set
    # by the rollout layer, not by workflows; concatenation keeps them in episode order.
    positions: list[int | None] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.data["input_ids"].shape[0])

    @staticmethod
    def concat(items: "list[Trajectory]", pad_id: int = 0) -> "Trajectory":
        """Concatenate along the batch dim, right-padding per-token tensors to the longest L."""
        import torch

        if not items:
            raise ValueError("Trajectory.concat needs at least one trajectory")
        max_len = max(t.data["input_ids"].shape[1] for t in items)
        out: dict[str, torch.Tensor] = {}
        # per-row objects (multi_modal: each row's images) of any item; an item without the key gets None rows
        listed = [k for k in dict.fromkeys(k for t in items for k in t.data) if any(
            isinstance(t.data.get(k), list) for t in items)]
        for key in listed:
            out[key] = [e for t in items for e in (t.data[key] if key in t.data else [None] * len(t))]
        for key in items[0].data:
            if key in out:
                continue
            parts = []
            for t in items:
                x = t.data[key]
                if x.dim() >= 2 and x.shape[1] != max_len and key_is_per_token(key, t):
                    # sampling_cutoff: -inf is "nothing cut" (engines/sampling_mask.py); routed_experts: -1
                    # is "not recorded" (engines/routing_replay.py)
                    fill = {"input_ids": pad_id, "versions": -1, "sampling_cutoff": float("-inf"),
                            "routed_experts": -1}.get(key, 0)
                    pad = x.new_full((x.shape[0], max_len - x.shape[1], *x.shape[2:]), fill)
                    x = torch.cat([x, pad], dim=1)
                parts.append(x)
            out[key] = torch.cat(parts, dim=0)
        meta: dict[str, Any] = {}
        for t in items:
            for k, v in t.meta.items():
                meta.setdefault(k, []).append(v)
        return Trajectory(out, meta, [p for t in items for p in (t.positions or [None])])


def key_is_per_token(key: str, t: Trajectory) -> bool:
    x = t.data[key]
    return x.dim() >= 2 and x.shape[1] == t.data["input_ids"].shape[1]


class RolloutWorkflow(abc.ABC):
    """Turns one dataset item into a scored trajectory batch (e.g. a GRPO group)."""

    @abc.abstractmethod
    async def arun_episode(self, engine: "InferenceEngine", data: dict[str, Any]) -> Trajectory | None:
        """Return the episode's trajectory, or ``None`` to reject it (it is not counted)."""
