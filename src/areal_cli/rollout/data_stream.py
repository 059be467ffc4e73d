"""A deterministic, resumable prompt stream that knows which prompts were actually trained on.

The rollout executor pulls prompts ahead of training (queued, running, finished but not yet
consumed), so "how far the dataloader got" is not "what the trainer used". The stream numbers every
prompt it hands out (:attr:`StreamItem.pos`); the trainer reports the positions it consumed; the saved state is
the lowest position not yet consumed plus the consumed positions above it. A resumed stream restarts
at that position and skips those, so after a crash no prompt is trained twice and none is lost.
In synchronous mode consumption is in order, so the state is a single position and a resumed run
sees exactly the prompts an uninterrupted one would.

Order: epoch ``e`` visits the items in ``random.Random(seed * 1009 + e).shuffle`` order (or in file
order with ``shuffle=False``).
"""

from __future__ import annotations

import random
import threading
from typing import Any


class StreamItem(dict):
    """A data item as the user's workflow sees it (a plain copy of the dataset row's dict) that also
    knows its position in the stream, as an attribute: the position never rides in the data."""

    def __init__(self, data: dict[str, Any], pos: int):
        super().__init__(data)
        self.pos = int(pos)

    def __reduce__(self):  # pickles (to a process-based worker) with its position
        return (StreamItem, (dict(self), self.pos))


def position(item: Any) -> int | None:
    """The stream position of ``item`` (None for a dict that did not come from a :class:`PromptStream`)."""
    return getattr(item, "pos", None)


class PromptStream:
    """An endless iterator over ``items`` (dicts), each yielded as a :class:`StreamItem` copy."""

    def __init__(self, items: list[dict[str, Any]], *, seed: int = 0, shuffle: bool = True):
        if not items:
            raise ValueError("PromptStream needs at least one item")
        self.items = items
        self.seed = int(seed)
        self.shuffle = shuffle
        self._next = 0
        self._skip: set[int] = set()
        self._consumed_above: set[int] = set()  # consumed positions >= _low
        self._low = 0  # every position below is consumed
        self._perm_epoch = -1
        self._perm: list[int] = []
        self._lock = threading.Lock()

    def _index(self, pos: int) -> int:
        n = len(self.items)
        epoch, off = divmod(pos, n)
        if epoch != self._perm_epoch:
            perm = list(range(n))
            if self.shuffle:
                random.Random(self.seed * 1009 + epoch).shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm[off]

    def epoch(self) -> int:
        return self._low // len(self.items)

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> StreamItem:
        with self._lock:
            while self._next in self._skip:
                self._skip.discard(self._next)
                self._next += 1
            pos = self._next
            self._next += 1
            return StreamItem(self.items[self._index(pos)], pos)

    def take(self, n: int) -> list[StreamItem]:
        return [next(self) for _ in range(n)]

    def mark_consumed(self, positions: list[int]) -> None:
        with self._lock:
            self._consumed_above.update(int(p) for p in positions)
            while self._low in self._consumed_above:
                self._consumed_above.discard(self._low)
                self._low += 1

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"position": self._low, "consumed_above": sorted(self._consumed_above),
                    "seed": self.seed, "n_items": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("n_items", len(self.items))) != len(self.items):
            raise ValueError(f"the saved data stream had {state['n_items']} items, this dataset has "
                             f"{len(self.items)}; resume with the same dataset")
        with self._lock:
            self._low = self._next = int(state["position"])
            self._consumed_above = set(int(p) for p in state.get("consumed_above", []))
            self._skip = set(self._consumed_above)
