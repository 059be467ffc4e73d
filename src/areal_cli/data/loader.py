"""A resumable loader over data items, like torchdata's ``StatefulDataLoader`` but dependency-free.

The shuffle order of epoch ``e`` is a pure function of ``(seed, e)``, so the whole state is
``(epoch, position)``: :meth:`state_dict` / :meth:`load_state_dict` resume at exactly the next
item an uninterrupted run would have produced. Data-parallel heads pass ``rank``/``world_size``
and see disjoint shards of each epoch's order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

STATE_VERSION = 1


class StatefulDataLoader:
    """Batches (lists of items) over epochs, with exact resume."""

    def __init__(self, items: Sequence[Any], batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, rank: int = 0, world_size: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.items = items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0  # items of this rank's shard consumed in the current epoch
        self._order: list[int] | None = None
        self._order_epoch = -1
        shard = len(items) // world_size
        if shard == 0:
            raise ValueError(f"{len(items)} items cannot be split over {world_size} ranks")
        if drop_last and shard < batch_size:
            raise ValueError(f"{shard} items per rank is fewer than one batch of {batch_size}")
        self._shard_len = shard

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def epoch_items(self) -> int:
        """Items this rank consumes per epoch (a multiple of batch_size when drop_last)."""
        if self.drop_last:
            return (self._shard_len // self.batch_size) * self.batch_size
        return self._shard_len

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-self.epoch_items // self.batch_size)

    # -- order ---------------------------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            idx = list(range(len(self.items)))
            if self.shuffle:
                random.Random(self.seed * 1_000_033 + self.epoch).shuffle(idx)
            # Equal-length shards: every rank does the same number of steps per epoch.
            idx = idx[: self._shard_len * self.world_size]
            self._order = idx[self.rank::self.world_size]
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def _roll_epoch_if_done(self) -> None:
        if self.position >= self.epoch_items:
            self.epoch += 1
            self.position = 0

    # -- consumption ---------------------------------------------------------------------------
    def next_item(self) -> Any:
        """The next single item (rolls over epochs); the rollout executor submits items one by one."""
        self._roll_epoch_if_done()
        item = self.items[self._epoch_order()[self.position]]
        self.position += 1
        return item

    def next_batch(self) -> list[Any]:
        """The next batch (rolls over epochs; the last short batch only when ``drop_last=False``)."""
        self._roll_epoch_if_done()
        order = self._epoch_order()
        end = min(self.position + self.batch_size, self.epoch_items)
        batch = [self.items[i] for i in order[self.position:end]]
        self.position = end
        return batch

    def __iter__(self) -> Iterator[list[Any]]:
        """The remaining batches of the current epoch; afterwards the loader is at the next epoch."""
        self._roll_epoch_if_done()
        start_epoch = self.epoch
        while self.epoch == start_epoch and self.position < self.epoch_items:
            yield self.next_batch()
        self._roll_epoch_if_done()

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": self.position,
                "seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size,
                "num_items": len(self.items), "rank": self.rank, "world_size": self.world_size,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The dataset and sharding must match the saved run's."""
        from areal_cli.errors import DataError

        for key, mine in (("num_items", len(self.items)), ("world_size", self.world_size),
                          ("rank", self.rank)):
            if key in state and state[key] != mine:
                raise DataError(f"cannot resume the dataloader: saved {key}={state[key]} but this run "
                                f"has {key}={mine} — fix: resume with the same dataset and allocation")
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order_epoch = -1
