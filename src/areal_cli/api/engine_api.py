"""The training-engine contract. One API over FSDP2, Megatron, Archon and DeepSpeed.

Batches are dicts of right-padded tensors with a leading batch dim ``[B, L]``:

- ``input_ids`` (long), ``attention_mask`` (bool; True on real tokens)
- ``loss_mask`` (float/bool; 1 where token ``i`` is a generated token to train on)
- optional per-token: ``logprobs`` (behaviour), ``prox_logp``, ``ref_logp``, ``advantages``,
  ``values``, ``returns``, ``versions`` (-1 on prompt tokens), ``sampling_cutoff`` (float;
  Keep-Sampling-Mask: token ``i`` was drawn from the tokens with ``logits / T >= sampling_cutoff[i]``,
  ``-inf`` where nothing was cut, on prompts and padding; when present, every logprob and entropy the
  engine returns is under that truncated, renormalised distribution, see ``engines/sampling_mask.py``),
  ``routed_experts`` (int16 ``[B, L, n_moe_layers * top_k]``; routing replay: the experts the inference
  server routed token ``i`` to in every MoE layer, ``-1`` where not recorded; when present, engines that
  support it run those experts, see ``engines/routing_replay.py``)
- optional per-sequence ``[B]``: ``rewards``, ``seq_no_eos_mask``
- optional ``multi_modal`` (images; a vision-language model, ``engines/vision.py``): a Python list of length
  ``B``, entry ``r`` ``None`` for a text row or ``{"pixel_values": float [n_patches_r, patch_dim],
  "image_grid_thw": long [n_images_r, 3]}`` exactly as the model's processor returns them for row ``r``'s
  images, in the order they appear in the row; the row's ``input_ids`` already hold the expanded
  ``<|image_pad|>`` tokens (one per merged patch). Everything that selects, splits, reorders, concatenates,
  broadcasts or scatters rows (micro-batch bins, the data-parallel split, the replica broadcast, the
  trainer's mini-batches and episode order) keeps each row's entry with its tokens; a batch without the key
  is a text batch, exactly as before. The engines compute each row's mrope positions from its ids and grids
  (the model's ``get_rope_index``) and run the tower inside the forward; ``fsdp`` (d, c) and ``archon``
  (d, t, c) take such batches, the others refuse a vision model (``validate-config``)

Position convention: per-token tensors are aligned with ``input_ids``; entry ``i`` concerns the
prediction of token ``i`` from tokens ``< i`` (entry 0 is always 0 / masked).

``loss_fn(outputs, mb) -> (loss, stats)`` receives, for one micro-batch, ``outputs`` with
``logprobs`` and ``entropy`` (actor) or ``values`` (critic), shaped like ``mb["input_ids"]``, and
returns a scalar loss that is a *mean over that micro-batch's units* (tokens or sequences) plus a
dict of float stats. ``loss_weight_fn(mb)`` returns the number of units in ``mb``. The engine
rescales each micro-batch loss by ``weight / global_weight`` (summed over all micro-batches and
data-parallel ranks), so gradients do not depend on how the batch was split or on the DP size.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

from areal_cli.api.io_struct import ParallelStrategy, SaveLoadMeta, WeightUpdateMeta

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

    import torch
    import torch.distributed as dist

    from areal_cli.api.inference_api import InferenceEngine

Batch = dict[str, "torch.Tensor"]
LossFn = Callable[[dict[str, "torch.Tensor"], Batch], "tuple[torch.Tensor, dict[str, float]]"]
LossWeightFn = Callable[[Batch], float]


class TrainEngine(abc.ABC):
    """A model being trained, sharded over some parallel strategy."""

    @abc.abstractmethod
    def initialize(self, parallel: ParallelStrategy, model_path: str, **kwargs: Any) -> None:
        """Load the model from a local HF dir and apply the parallel strategy.

        ``peers``: the engines already initialised in this process that this one lives beside (a policy for
        its reference, critic or teacher); an engine whose backend keeps process-global state (megatron-core's
        parallel state) shares it with theirs instead of creating it. Other engines ignore it."""

    @abc.abstractmethod
    def train_batch(self, batch: Batch | None, loss_fn: LossFn, loss_weight_fn: LossWeightFn,
                    temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batch`` (split into micro-batches internally).

        ``outputs["logprobs"]`` handed to ``loss_fn`` are computed at ``temperature`` (the sampling
        temperature of the rollout). Every rank calls it; ranks of one data-parallel replica pass the
        same rows (the replica's share), and a rank that is not the replica's head may pass None.
        Returns stats that include ``grad_norm`` and ``lr``.
        """

    @abc.abstractmethod
    def forward(self, batch: Batch, output: str = "logprobs", temperature: float = 1.0) -> "dict[str, torch.Tensor]":
        """No-grad forward. ``output="logprobs"`` → {"logprobs", "entropy"}; ``"values"`` → {"values"}."""

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta, engines: "list[InferenceEngine]",
                       loop: "asyncio.AbstractEventLoop | None" = None) -> None:
        """Push current weights to inference servers (pause → sync → continue) and bump versions.

        Collective over all trainer ranks; only global rank 0 talks to ``engines``. ``loop`` is the
        running event loop (in another thread) that owns the clients' HTTP sessions; None means the
        engine runs its own.
        """

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @property
    @abc.abstractmethod
    def dp_group(self) -> "dist.ProcessGroup | None": ...

    @property
    @abc.abstractmethod
    def dp_rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def dp_world_size(self) -> int: ...

    @property
    def is_dp_head(self) -> bool:
        """True on the one rank of each data-parallel replica whose batch is authoritative."""
        return True

    def dp_all_reduce(self, t: "torch.Tensor") -> "torch.Tensor":
        """Sum ``t`` over the data-parallel replicas into a new tensor (a copy at dp=1).

        Batch-level statistics (advantage whitening, reward means) use it: each replica holds only
        its share of the step's episodes, and the ranks inside one replica must count it once.
        """
        out = t.detach().clone()
        if self.dp_world_size > 1:
            from areal_cli.utils import collectives

            collectives.all_reduce(out, group=self.dp_group)
        return out

    def warm_up(self) -> None:
        """Optional: run one throw-away step (lr 0, state dropped) so lazy allocations and kernel
        selection happen while the first rollout is generated. Must leave the model unchanged."""

    def destroy(self) -> None:
        """Free process groups and memory."""
