"""Prefix cache of the built-in ``hf`` server: the KV of sequences it ran, reused by later requests.

A multi-turn agent sends its whole conversation every turn, and the members of a GRPO group (or
every episode of a task) share a system prompt: without a cache each call prefills all of it again.
When a row is prefilled, its prompt's KV is copied here, and when it leaves the running batch, the KV
of everything it fed through the model (prompt + all output but the last token); a new request whose
tokens start with a cached sequence copies that KV into its slab row and prefills only the rest
(:meth:`FastRunner.prefill` ``cached=``). Rows admitted together that share a prefix go one
admission apart (:meth:`PrefixCache.followers`), so concurrent episodes compute their system prompt once.

Layout: one entry per stored sequence, ``kv`` ``[layers, 2, kv_heads, n, head_dim]``; an index from
the chained hash of every full block of ``BLOCK`` tokens (keyed by the LoRA adapter too: another
adapter has other KV) to the entries holding that prefix. A lookup walks the request's blocks while
the index has them, extends the match token by token inside the entries found at the deepest block,
and checks the chosen entry's tokens (a hash collision cannot serve wrong KV). An entry that another
one extends is dropped when the longer one comes in (a conversation's next turn replaces the previous
one). Entries are not deduplicated against each other: eight samples of one prompt hold eight copies
of it, and the token budget counts every copy, so the bound on memory is exact.

Bounded by ``budget`` tokens, least recently used first out. The engine clears it before every
command it runs (weight updates, LoRA load/unload, version change, pause, ``/flush_cache``) and never
stores a row admitted before the last clear, so no request reuses KV computed with other weights.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per hashed block: a lookup walks len/BLOCK dict probes


@dataclass
class _Entry:
    eid: int
    adapter: str | None
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, n, head_dim]
    keys: list[tuple]


class PrefixCache:
    """See the module docstring. Engine thread only."""

    CANDIDATES = 32  # entries sharing a lookup's deepest block whose partial last block is compared

    def __init__(self, budget_tokens: int, block: int = BLOCK):
        self.budget = int(budget_tokens)
        self.block = int(block)
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # LRU first
        self._index: dict[tuple, dict[int, None]] = {}  # block key -> entry ids (insertion-ordered)
        self._ids = itertools.count()
        self.tokens = 0  # tokens held (every entry's full length)
        self.hits = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, adapter: str | None, tokens: tuple[int, ...] | list[int], n_blocks: int):
        h, b = hash(adapter), self.block
        for i in range(n_blocks):
            h = hash((h, tuple(tokens[i * b:(i + 1) * b])))
            yield (adapter, h)

    def lookup(self, adapter: str | None, tokens: list[int] | tuple[int, ...], limit: int,
               touch: bool = True) -> tuple[_Entry | None, int]:
        """The entry holding the longest cached prefix of ``tokens`` (at most ``limit`` tokens) and
        that prefix's length; ``(None, 0)`` when no full block matches."""
        limit = min(limit, len(tokens))
        found: dict[int, None] | None = None
        depth = 0
        for d, key in enumerate(self._keys(adapter, tokens, limit // self.block), start=1):
            ids = self._index.get(key)
            if not ids:
                break
            found, depth = ids, d
        if found is None:
            return None, 0
        # Entries past the deepest common block differ in their last, partial block: take the one that
        # matches longest (ties: the most recent), among the most recent few.
        best, m = None, depth * self.block
        for eid in itertools.islice(reversed(found), self.CANDIDATES):
            e, k = self._entries[eid], depth * self.block
            end = min(limit, len(e.tokens))
            while k < end and e.tokens[k] == tokens[k]:
                k += 1
            if best is None or k > m:
                best, m = e, k
        if best.tokens[:depth * self.block] != tuple(tokens[:depth * self.block]):  # hash collision
            return None, 0
        if touch:
            self._entries.move_to_end(best.eid)
            self.hits += 1
        return best, m

    def insert(self, adapter: str | None, tokens: tuple[int, ...],
               kv_of: Callable[[int], torch.Tensor]) -> bool:
        """Store the KV of ``tokens`` (``kv_of(n)`` copies it out of the running cache, called only when
        it is stored). Returns whether anything was stored."""
        n = len(tokens)
        if n < self.block or n > self.budget:
            return False
        have, m = self.lookup(adapter, tokens, n, touch=False)
        if have is not None and m == n:  # already covered by a longer (or equal) sequence
            self._entries.move_to_end(have.eid)
            return False
        if have is not None and m == len(have.tokens):  # this one extends it (the next turn)
            self._drop(have)
        e = _Entry(next(self._ids), adapter, tokens, kv_of(n), [])
        e.keys = list(self._keys(adapter, tokens, n // self.block))
        for k in e.keys:
            self._index.setdefault(k, {})[e.eid] = None
        self._entries[e.eid] = e
        self.tokens += n
        while self.tokens > self.budget:
            self._drop(next(iter(self._entries.values())))
            self.evicted += 1
        return True

    def followers(self, rows: list[tuple[str | None, list[int]]]) -> list[bool]:
        """Per row of one admission batch (``(adapter, tokens)``): True when it shares at least one more
        full block with an earlier row of the batch than the cache holds for it, and is not identical to
        it (identical prompts share one prefill anyway). Admitted one step after that row, whose prompt is
        stored when it is prefilled, it prefills only what the cache lacks: episodes that start together
        with one system prompt compute it once."""
        seen: set[tuple] = set()
        whole: set[tuple] = set()
        out = []
        for adapter, toks in rows:
            t = (adapter, tuple(toks))
            if t in whole:
                out.append(False)
                continue
            keys = list(self._keys(adapter, toks, (len(toks) - 1) // self.block))
            d = 0
            while d < len(keys) and keys[d] in seen:
                d += 1
            if d and d * self.block - self.lookup(adapter, toks, len(toks) - 1, touch=False)[1] >= self.block:
                out.append(True)
                continue
            seen.update(keys)
            whole.add(t)
            out.append(False)
        return out

    def _drop(self, e: _Entry) -> None:
        del self._entries[e.eid]
        self.tokens -= len(e.tokens)
        for k in e.keys:
            ids = self._index.get(k)
            if ids is not None:
                ids.pop(e.eid, None)
                if not ids:
                    del self._index[k]

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.tokens = 0


def bytes_per_token(runner) -> int:
    """KV bytes one cached token costs with this runner's model (K and V of every layer)."""
    elem = torch.empty((), dtype=runner.dtype).element_size()
    return len(runner.layers) * 2 * runner.n_kv * runner.head_dim * elem


def auto_budget(runner, mib: int = 512, cap: int = 1 << 16) -> int:
    """The default token budget: as many tokens as fit in ``mib`` MiB, at most ``cap``."""
    return max(0, min(cap, (mib << 20) // bytes_per_token(runner)))
