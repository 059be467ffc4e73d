"""Continuous-batching generation engine of the built-in ``hf`` server.

One background thread owns the model and, through a *runner*, the KV cache of the running batch.
Each loop iteration is one token boundary:

1. run queued commands (weight swaps, pause, flush) — so weights change atomically between steps;
2. admit waiting requests: one prefill for all of them, appended as new rows of the running cache
   (a prompt identical to one admitted with it, or to a running row's, is prefilled once: its KV
   rows are copied, see :meth:`GenerationEngine._prefill_shared`; a prompt that starts with a
   finished sequence's tokens copies their KV from the prefix cache and prefills only the rest,
   see :mod:`~areal_cli.inference.server.prefix_cache` — fast path only);
3. one decode forward for the whole running batch;
4. sample all rows in one vectorised pass, append, and retire finished rows (cache rows compacted).

Runners: :class:`~areal_cli.inference.server.fastpath.FastRunner` (default on CPU for Llama-family
models: fused, pre-transposed weights, ragged in-place KV slabs, unpadded prefill) and
:class:`HFRunner` (HF's own forward over a left-padded ``DynamicCache``, for everything else).
Requests join and leave at every boundary, so a long generation never blocks short ones.
Logprob convention: ``log_softmax(logits / T)[token]`` before top-k/top-p truncation (``T = 1``
for greedy rows), matching :class:`areal_cli.api.io_struct.GenerationConfig`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from areal_cli.inference.server import lora
from areal_cli.inference.server.sampling import SamplingParams, sample_next

log = logging.getLogger("areal_cli.hf_server")


@dataclass
class Sequence:
    """One request inside the engine."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[["Sequence"], None]
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    # Keep-Sampling-Mask (``return_sampling_mask``): per token, the kept set's logit cutoff at the
    # sampling temperature (None: nothing cut) and the logprob under the truncated distribution.
    record_mask: bool = False
    out_cutoffs: list[float | None] = field(default_factory=list)
    out_masked_logprobs: list[float] = field(default_factory=list)
    # Routing replay (``return_routed_experts``): per fed token, each MoE layer's top-k experts, in
    # chunks of ``[n, n_layers, top_k]`` (one per prefill / decode step), prompt tokens included.
    record_routing: bool = False
    routing: list[torch.Tensor] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    cancelled: bool = False
    real_len: int = 0  # prompt + generated tokens already in the KV cache
    cached_tokens: int = 0  # prompt tokens whose KV was copied (identical prompt, prefix cache), not computed
    epoch: int = -1  # the engine's weights epoch at admission (its KV may enter the prefix cache only then)
    prefix_key: tuple | None = None  # (adapter, tokens) this row was admitted with (shared prefill)
    deferred: bool = False  # held back one admission to reuse an earlier row's prefix (prefix cache)
    text_tail: str = ""  # decoded output (only maintained for stop-string requests)
    lora: str | None = None  # the LoRA adapter this request runs with (SGLang's lora_path); None: the base
    images: Any = None  # media.VisionInputs of a prompt with images: it runs in the image sub-batch (vision.py)


@dataclass
class _Prefix:
    """A prompt whose KV rows are in the running cache: the rows holding it and its last-token logits."""

    logits: torch.Tensor  # [V], fp32
    holders: list[Sequence]
    routing: torch.Tensor | None = None  # [n, n_layers, top_k] when the prefill recorded it


class GenerationEngine:
    """Owns the model; serves requests in a background thread (see module docstring)."""

    def __init__(self, model, tokenizer, *, device: str, max_running: int = 256,
                 max_prefill_tokens: int = 8192, context_length: int, version: int = 0, seed: int = 0,
                 fast_path: bool | None = None, decode_attention: str = "auto", prefix_cache_tokens: int = 0):
        """``prefix_cache_tokens``: token budget of the prefix cache (0: off; -1: ``auto_budget``, 512 MiB
        of KV). The HF-forward runner has no cache (its left-padded DynamicCache rows are not exported):
        there the flag is ignored and every prompt is prefilled in full."""
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.version = version
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # On the model's device: torch.multinomial needs a generator of its input's device.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque())
        self._cv = threading.Condition()
        self._paused = False
        self._cancel_pending = False  # a cancelled request waits to be dropped (wakes a paused engine)
        self._stopping = False
        self._running: list[Sequence] = []
        self._prefixes: dict[tuple, _Prefix] = {}
        self.runner = _make_runner(model, self.device, fast_path, self.pad_id, decode_attention)
        # Requests with images run in their own sub-batch (mrope positions, the vision tower in prefill):
        # vision.VisionBatch, attached by the server for a vision-language model (vision.attach).
        self.vision = None
        self.banned_ids: torch.Tensor | None = None  # never sampled (a VL model's vision tokens: vision.attach)
        self.adapters = lora.AdapterSet()
        self._capture = None  # routing_replay.Capture, made on the first request that records routing
        self.stats = {"steps": 0, "generated_tokens": 0, "prefill_tokens": 0, "shared_prefill_tokens": 0,
                      "cached_prefill_tokens": 0, "finished": 0}
        self._epoch = 0  # bumped after every command batch: KV of rows admitted before it is not cached
        self.prefix_cache = self._make_prefix_cache(prefix_cache_tokens)
        self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)

    def _make_prefix_cache(self, tokens: int):
        from areal_cli.inference.server import prefix_cache as PC

        if tokens == 0:
            return None
        if not hasattr(self.runner, "export"):
            log.info("prefix cache: off (the HF-forward path has none)")
            return None
        per = PC.bytes_per_token(self.runner)
        if tokens < 0:
            tokens = PC.auto_budget(self.runner)
        log.info("prefix cache: %d tokens, up to %.0f MiB (%.1f KiB of KV per token)", tokens,
                 tokens * per / 2**20, per / 1024)
        return PC.PrefixCache(tokens) if tokens > 0 else None

    def cache_stats(self) -> dict[str, int]:
        """Counters for ``/get_load``: the engine's plus the prefix cache's size."""
        out = dict(self.stats)
        pc = self.prefix_cache
        out.update(prefix_cache_budget=pc.budget if pc else 0, prefix_cache_tokens=pc.tokens if pc else 0,
                   prefix_cache_entries=len(pc) if pc else 0, prefix_cache_hits=pc.hits if pc else 0)
        return out

    # ----------------------------------------------------------------- public (any thread)
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> None:
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify_all()

    def cancel(self, rid: str) -> None:
        """Drop a request whose caller went away (finished at the next boundary, paused or not)."""
        with self._cv:
            for s in list(self._waiting) + self._running + self._vision_running():
                if s.rid == rid:
                    s.cancelled = True
                    self._cancel_pending = True
            self._cv.notify_all()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` in the engine thread at the next token boundary."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    @contextlib.contextmanager
    def same_boundary(self) -> Iterator[None]:
        """Commands queued inside this block (``call``, ``pause``, ``resume``) run back to back, in
        order, at one token boundary: no decode step can fall between them."""
        with self._cv:  # a Condition over an RLock: the calls inside re-acquire it
            yield

    def pause(self) -> concurrent.futures.Future:
        """Abort every running request (partial tokens returned) and hold new ones."""

        def _do() -> int:
            self._paused = True
            n = len(self._running)
            msg = {"type": "abort", "message": "generation paused for a weight update"}
            for s in self._running:
                s.finish = dict(msg)
            self._retire(list(range(len(self._running))))
            return n + (self.vision.finish_all(msg) if self.vision is not None else 0)

        return self.call(_do)

    def resume(self) -> concurrent.futures.Future:
        def _do() -> None:
            self._paused = False

        return self.call(_do)

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        with self._cv:
            return {"running": len(self._running) + len(self._vision_running()), "waiting": len(self._waiting)}

    def _vision_running(self) -> list[Sequence]:
        return self.vision.running if self.vision is not None else []

    # ----------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while (not self._stopping and not self._commands and not self._cancel_pending
                       and not self._running and not self._vision_running()
                       and (self._paused or not self._waiting)):
                    self._cv.wait(timeout=0.5)
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            if commands:
                self._run_commands(commands)
            try:
                self._drop_cancelled()
                if not self._paused:
                    self._admit()
                if self._running:
                    self._decode_step()
                if self._vision_running():
                    self.vision.step()
            except Exception as e:  # never let one bad batch kill the server
                log.exception("engine step failed")
                err = {"type": "error", "message": f"engine error: {type(e).__name__}: {e}"}
                for s in self._running:
                    # Not an "abort": clients resubmit aborted requests (a weight-update pause), and a
                    # failure that repeats would loop (seen on CUDA: 1001 resubmissions). "error" fails them.
                    s.finish = dict(err)
                self._retire(list(range(len(self._running))))
                if self.vision is not None:
                    self.vision.finish_all(err)
        for s in self._running + self._vision_running() + list(self._waiting):
            s.finish = {"type": "abort", "message": "server shutting down"}
            self._finish(s)

    def _drop_cancelled(self) -> None:
        with self._cv:
            self._cancel_pending = False
            dropped = [s for s in self._waiting if s.cancelled]
            self._waiting = collections.deque(s for s in self._waiting if not s.cancelled)
        for s in dropped:  # finished, so the handler awaiting it returns instead of hanging forever
            s.finish = {"type": "abort", "message": "client disconnected"}
            self._finish(s)
        gone = [i for i, s in enumerate(self._running) if s.cancelled]
        for i in gone:
            self._running[i].finish = {"type": "abort", "message": "client disconnected"}
        if gone:
            self._retire(gone)
        if self.vision is not None:
            self.vision.drop_cancelled()

    def _run_commands(self, commands: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        self._prefixes.clear()  # a command may have changed the weights: running prompts' KV is stale for new rows
        # Before them: a caller sees the cache dropped once its command returned, and rows they retire
        # (a pause) were admitted in the old epoch, so they are not stored.
        self._new_epoch()
        for fn, fut in commands:
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to the HTTP caller, engine keeps going
                fut.set_exception(e)

    def _new_epoch(self) -> None:
        """Weights may have changed: drop the prefix cache, and keep rows admitted so far out of it."""
        self._epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _admit(self) -> None:
        batch: list[Sequence] = []
        imaged: list[Sequence] = []
        budget = self.max_prefill_tokens
        with self._cv:
            while self._waiting and (len(self._running) + len(self._vision_running()) + len(batch)
                                     + len(imaged) < self.max_running):
                s = self._waiting[0]
                if s.lora is not None and s.lora not in self.adapters.by_name:  # unloaded while it waited
                    self._waiting.popleft()
                    s.finish = {"type": "abort", "message": f"LoRA adapter {s.lora!r} was unloaded"}
                    self._finish(s)
                    continue
                n = len(s.prompt_ids) + len(s.out_ids)
                group = imaged if s.images is not None else batch
                if group and n * (len(group) + 1) > budget:
                    break
                group.append(self._waiting.popleft())
        if imaged:
            self.vision.admit(imaged)
        if len(batch) > 1 and self.prefix_cache is not None:
            batch = self._defer_followers(batch)
        if batch:
            self._prefill_shared(batch)

    def _defer_followers(self, batch: list[Sequence]) -> list[Sequence]:
        """Hold back (once) rows that share a prefix with an earlier row of the batch: the next admission
        finds it in the prefix cache (see ``PrefixCache.followers``)."""
        flags = self.prefix_cache.followers([(s.lora, s.prompt_ids + s.out_ids) for s in batch])
        later = [s for s, f in zip(batch, flags) if f and not s.deferred and not s.record_routing]
        if not later:
            return batch
        for s in later:
            s.deferred = True
        with self._cv:
            self._waiting.extendleft(reversed(later))
        held = {id(s) for s in later}
        return [s for s in batch if id(s) not in held]

    def _prefill_shared(self, batch: list[Sequence]) -> None:
        """Prefill each distinct token sequence once; every other request with the same tokens gets a
        copy of the KV rows (from a row admitted now or one still running) and the same first logits.

        A GRPO group sends ``group_size`` requests with one prompt: this prefills it once, not 8 times.
        Rows join the running batch as [computed..., copies...] (row order is not observable: seeded
        sampling does not depend on it).
        """
        # The adapter is part of the key: the same prompt under another adapter has other KV.
        keys = [(s.lora, tuple(s.prompt_ids + s.out_ids)) for s in batch]
        computed: dict[tuple, Sequence] = {}
        copies: list[Sequence] = []
        for s, k in zip(batch, keys):
            s.prefix_key = k
            held = self._prefixes.get(k)
            if k in computed or (held is not None and (held.routing is not None or not s.record_routing)):
                copies.append(s)
            else:  # a running prefix without recorded routing is computed again for a row that records it
                computed[k] = s
        firsts = list(computed.values())
        for s in batch:
            s.epoch = self._epoch
        if firsts:
            self._set_row_adapters(firsts)
            routed = self._capture_for(firsts)
            hits = self._cache_hits(list(computed), firsts)
            if any(hits):
                logits = self.runner.prefill([list(k[1]) for k in computed], cached=hits)
            else:
                logits = self.runner.prefill([list(k[1]) for k in computed])
            rt = self._take_routing(len(firsts)) if routed else None
            if self.prefix_cache is not None:  # now, not only when they finish: a follower may start with it
                r0 = len(self._running)
                for i, (k, s) in enumerate(zip(computed, firsts)):
                    if not s.record_routing:
                        self.prefix_cache.insert(k[0], k[1], lambda n, row=r0 + i: self.runner.export(row, n))
            for i, (k, s, row) in enumerate(zip(computed, firsts, logits)):
                old = self._prefixes.get(k)
                r = None if rt is None else rt[i, rt.shape[1] - len(k[1]):]
                self._prefixes[k] = _Prefix(logits=row.clone(), holders=[s] + (old.holders if old else []),
                                            routing=r)
            reused = [h[1] if h else 0 for h in hits]
            for s, m in zip(firsts, reused):
                s.cached_tokens = m
            self.stats["prefill_tokens"] += sum(len(k[1]) for k in computed) - sum(reused)
            self.stats["cached_prefill_tokens"] += sum(reused)
            self._running.extend(firsts)
        if copies:
            at = {id(s): i for i, s in enumerate(self._running)}
            src = [at[id(self._prefixes[s.prefix_key].holders[0])] for s in copies]
            self.runner.fork(src, [len(s.prefix_key[1]) for s in copies])
            for s in copies:
                self._prefixes[s.prefix_key].holders.append(s)
                s.cached_tokens = len(s.prefix_key[1])
            self.stats["shared_prefill_tokens"] += sum(len(s.prefix_key[1]) for s in copies)
            self._running.extend(copies)
        ordered = firsts + copies
        for s in ordered:
            s.real_len = len(s.prefix_key[1])
            if s.record_routing:
                s.routing.append(self._prefixes[s.prefix_key].routing)
        logits = torch.stack([self._prefixes[s.prefix_key].logits for s in ordered])
        self._sample_and_append(logits, rows=list(range(len(self._running) - len(ordered), len(self._running))))

    def _cache_hits(self, keys: list[tuple], seqs: list[Sequence]) -> list[tuple[torch.Tensor, int] | None]:
        """Per row to prefill, ``(kv, m)`` of its longest prefix in the prefix cache (None: no hit). At
        least the last token is computed: its logits sample the first new token."""
        pc = self.prefix_cache
        if pc is None or not len(pc):
            return [None] * len(keys)
        out: list[tuple[torch.Tensor, int] | None] = []
        for (adapter, toks), s in zip(keys, seqs):
            e, m = (None, 0) if s.record_routing else pc.lookup(adapter, toks, len(toks) - 1)
            out.append((e.kv, m) if e is not None and m > 0 else None)
        return out

    def _store_prefixes(self, rows: list[int]) -> None:
        """Copy the KV of leaving rows into the prefix cache (before the runner compacts them away)."""
        pc = self.prefix_cache
        if pc is None:
            return
        for i in rows:
            s = self._running[i]
            if s.epoch != self._epoch or (s.finish or {}).get("type") == "error":
                continue
            n = min(s.real_len, self.runner.lens[i])
            toks = tuple((s.prompt_ids + s.out_ids)[:n])
            pc.insert(s.lora, toks, lambda k, row=i: self.runner.export(row, k))

    def routing_unsupported(self) -> str | None:
        """Why this model's routed experts cannot be recorded (None: they can)."""
        from areal_cli.engines.routing_replay import unknown_moe_reason

        if not isinstance(self.runner, HFRunner):
            return "the fast decode path runs dense models only"
        return unknown_moe_reason(self.model)

    def _capture_for(self, seqs: list[Sequence]) -> bool:
        """Turn routing capture on for the next forward when a row of ``seqs`` asks for it."""
        want = any(s.record_routing for s in seqs)
        if want and self._capture is None:
            from areal_cli.engines.routing_replay import Capture

            self._capture = Capture(self.model)
        if self._capture is not None:
            self._capture.active = want
        return want

    def _take_routing(self, n_rows: int) -> torch.Tensor:
        """The last forward's routing as ``[n_rows, width, n_layers, top_k]`` (left-padded like the batch)."""
        self._capture.active = False
        r = self._capture.take()
        return r.view(n_rows, -1, *r.shape[1:])

    def _set_row_adapters(self, seqs: list[Sequence]) -> None:
        by_name = self.adapters.by_name
        self.runner.row_adapters = [by_name[s.lora] if s.lora is not None else None for s in seqs]

    def load_adapter(self, adapter: "lora.Adapter") -> dict[str, str]:
        """Engine thread (via :meth:`call`): add a loaded adapter."""
        self.adapters.add(adapter)
        return self.adapters.listing()

    def unload_adapter(self, name: str) -> dict[str, str]:
        """Engine thread (via :meth:`call`): remove an adapter; requests running with it are aborted."""
        self.adapters.remove(name)
        rows = [i for i, s in enumerate(self._running) if s.lora == name]
        for i in rows:
            self._running[i].finish = {"type": "abort", "message": f"LoRA adapter {name!r} was unloaded"}
        if rows:
            self._retire(rows)
        return self.adapters.listing()

    def _decode_step(self) -> None:
        self._set_row_adapters(self._running)
        routed = self._capture_for(self._running)
        logits = self.runner.decode([s.out_ids[-1] for s in self._running])
        rt = self._take_routing(len(self._running)) if routed else None
        for i, s in enumerate(self._running):
            s.real_len += 1
            if rt is not None and s.record_routing:
                s.routing.append(rt[i])
        self.stats["steps"] += 1
        self._sample_and_append(logits, rows=list(range(len(self._running))))

    def _sample_and_append(self, logits: torch.Tensor, rows: list[int]) -> None:
        done = self._sample_into(logits, [self._running[i] for i in rows])
        if done:
            self._retire([rows[j] for j in done])

    def _sample_into(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sample one token for each of ``seqs`` and append it; the indices (into ``seqs``) that finished."""
        with_mask = any(s.record_mask for s in seqs)
        out = sample_next(logits, [s.params for s in seqs], [len(s.out_ids) for s in seqs],
                          self.eos_ids, self.generator,
                          positions=[len(s.prompt_ids) + len(s.out_ids) for s in seqs],
                          with_mask=with_mask, banned=self.banned_ids)
        next_ids, logps = out[0], out[1]
        if with_mask:
            for s, c, mlp in zip(seqs, out[2].tolist(), out[3].tolist()):
                if s.record_mask:  # JSON has no -inf: None means nothing was cut
                    s.out_cutoffs.append(None if c == float("-inf") else c)
                    s.out_masked_logprobs.append(mlp)
        now = time.monotonic()
        done: list[int] = []
        for row, (s, tok, lp) in enumerate(zip(seqs, next_ids.tolist(), logps.tolist())):
            if not s.out_ids and not s.first_token_at:
                s.first_token_at = now
            s.out_ids.append(tok)
            s.out_logprobs.append(lp)
            s.out_versions.append(self.version)
            if self._check_finished(s, tok):
                done.append(row)
        self.stats["generated_tokens"] += len(seqs)
        return done

    def _check_finished(self, s: Sequence, tok: int) -> bool:
        p = s.params
        n = len(s.out_ids)
        if n >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                s.finish = {"type": "stop", "matched": tok}
                return True
            if p.stop:
                s.text_tail = self.tokenizer.decode(s.out_ids[-64:], skip_special_tokens=False)
                for st in p.stop:
                    if st and st in s.text_tail:
                        s.finish = {"type": "stop", "matched": st}
                        return True
        if n >= p.max_new_tokens or s.real_len + 1 >= self.context_length:
            s.finish = {"type": "length", "length": n}
            return True
        return False

    def _retire(self, rows: list[int]) -> None:
        self._store_prefixes(sorted(set(rows)))

        def finish(s: Sequence) -> None:
            self._release_prefix(s)
            self._finish(s)

        self._running = retire_rows(self._running, rows, self.runner, finish)

    def _release_prefix(self, s: Sequence) -> None:
        p = self._prefixes.get(s.prefix_key) if s.prefix_key is not None else None
        if p is not None:
            p.holders = [h for h in p.holders if h is not s]
            if not p.holders:
                del self._prefixes[s.prefix_key]

    def _finish(self, s: Sequence) -> None:
        s.finished_at = time.monotonic()
        self.stats["finished"] += 1
        try:
            s.on_done(s)
        except Exception:  # a closed event loop must not stop the engine
            log.exception("completion callback failed for %s", s.rid)


def retire_rows(running: list[Sequence], rows: list[int], runner, finish) -> list[Sequence]:
    """``running`` without ``rows`` (each handed to ``finish`` first, in order), and ``runner``'s cache cut to the
    rows kept: the text batch's and the image sub-batch's retirement (server/vision.py)."""
    drop = set(rows)
    for i in sorted(drop):
        finish(running[i])
    keep = [i for i in range(len(running)) if i not in drop]
    if keep:
        runner.keep(keep)
    else:
        runner.clear()
    return [running[i] for i in keep]


def _make_runner(model, device: torch.device, fast_path: bool | None, pad_id: int,
                 decode_attention: str = "auto"):
    """The model runner: :class:`FastRunner` when it supports the architecture, else :class:`HFRunner`.

    ``fast_path=None`` (auto) uses the fast path on CPU when the server runs its own attention
    (``areal_sdpa``, i.e. without ``--stock-attention``); ``True`` requires it; ``False`` always runs HF's
    forward. Auto stays off on CUDA: the fast path holds a second (fused) copy of the projection
    weights, and its gains were measured on CPU only. ``decode_attention`` (``auto|kernel|torch``) picks
    the fast path's decode attention, see :class:`FastRunner`.
    """
    from areal_cli.inference.server.attention import NAME as AREAL_ATTN
    from areal_cli.inference.server.fastpath import FastRunner, unsupported_reason

    reason = unsupported_reason(model)
    if fast_path is None:
        fast_path = (reason is None and device.type == "cpu"
                     and getattr(model.config, "_attn_implementation", None) == AREAL_ATTN)
    elif fast_path and reason is not None:
        raise ValueError(f"the fast decode path cannot run this model: {reason}")
    if fast_path:
        runner = FastRunner(model, device, attention=decode_attention)
        log.info("decode path: fast (fused pre-transposed weights, in-place KV slabs, %s attention)",
                 runner.attention)
        return runner
    log.info("decode path: HF forward%s", f" ({reason})" if reason else "")
    return HFRunner(model, device, pad_id)


class HFRunner:
    """Runs HF's own forward over a left-padded batched ``DynamicCache`` whose layers are slabs.

    Same interface as :class:`~areal_cli.inference.server.fastpath.FastRunner`: ``prefill`` appends
    rows, ``decode`` advances every row by one token, ``keep``/``clear`` retire rows.
    """

    def __init__(self, model, device: torch.device, pad_id: int):
        self.model, self.device, self.pad_id = model, device, pad_id
        self._cache = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 = real token
        self.lens: list[int] = []
        self.row_adapters: list = []  # LoRA: the adapter of each row of the next forward (set by the engine)
        self._hooks: lora.HFHooks | None = None
        # transformers' causal LMs take logits_to_keep (only the last position's logits are computed at
        # prefill); a custom architecture that does not is asked for all of them, and its forward's
        # other errors are its own.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _set_lora(self, n: int) -> None:
        groups = lora.row_groups(self.row_adapters[:n], None, self.device)
        if groups and self._hooks is None:
            self._hooks = lora.HFHooks(self.model)
        if self._hooks is not None:
            self._hooks.groups = groups

    def _forward(self, input_ids, mask, position_ids, cache, last_only: bool):
        kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                      past_key_values=cache, use_cache=True)
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :].float(), out.past_key_values

    @torch.no_grad()
    def prefill(self, seqs: list[list[int]]) -> torch.Tensor:
        from transformers import DynamicCache

        n_max = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), n_max), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), n_max), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, n_max - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, n_max - len(x):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        self._set_lora(len(seqs))
        cache = DynamicCache(config=self.model.config)
        logits, cache = self._forward(ids.to(self.device), mask.to(self.device), pos.to(self.device),
                                      cache, last_only=True)
        self._merge(cache, mask.to(self.device))
        self.lens.extend(len(x) for x in seqs)
        return logits

    def _merge(self, cache, mask: torch.Tensor) -> None:
        if self._cache is None:
            for li, layer in enumerate(cache.layers):
                cache.layers[li] = SlabLayer(layer.keys, layer.values)
            self._cache, self._mask = cache, mask
            return
        length = max(self._mask.shape[1], mask.shape[1])
        for li, (layer_a, layer_b) in enumerate(zip(self._cache.layers, cache.layers)):
            k = torch.cat([_lpad(layer_a.keys, length), _lpad(layer_b.keys, length)], dim=0)
            v = torch.cat([_lpad(layer_a.values, length), _lpad(layer_b.values, length)], dim=0)
            self._cache.layers[li] = SlabLayer(k, v)
        self._mask = torch.cat([_lpad(self._mask, length, dim=1), _lpad(mask, length, dim=1)], dim=0)

    @torch.no_grad()
    def fork(self, src: list[int], lengths: list[int]) -> None:
        """Append rows holding copies of the first ``lengths[i]`` cached tokens of rows ``src[i]``."""
        from types import SimpleNamespace

        it = torch.tensor(src, dtype=torch.long, device=self.device)
        n_len = torch.tensor(lengths, dtype=torch.long, device=self.device)
        width = max(lengths)
        # Rows are left-padded: row i's tokens are its last ``lens[i]`` columns.
        start = self._mask.shape[1] - torch.tensor([self.lens[i] for i in src], dtype=torch.long,
                                                   device=self.device)
        j = torch.arange(width, device=self.device).unsqueeze(0)
        mask = (j >= width - n_len.unsqueeze(1)).long()  # [m, width], new rows left-padded to ``width``
        cols = (start.unsqueeze(1) + j - (width - n_len.unsqueeze(1))).clamp(min=0)
        layers = []
        for layer in self._cache.layers:
            def take(t: torch.Tensor) -> torch.Tensor:
                t = t.index_select(0, it)
                idx = cols.view(len(src), 1, width, 1).expand(-1, t.shape[1], -1, t.shape[3])
                return t.gather(2, idx) * mask.view(len(src), 1, width, 1).to(t.dtype)

            layers.append(SimpleNamespace(keys=take(layer.keys), values=take(layer.values)))
        self._merge(SimpleNamespace(layers=layers), mask)
        self.lens.extend(lengths)

    def _decode_positions(self) -> torch.Tensor:
        """Each row's position of its next token (``[B, 1]``; a multimodal runner's own layout)."""
        return torch.tensor(self.lens, dtype=torch.long, device=self.device).unsqueeze(1)

    @torch.no_grad()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        self._set_lora(len(tokens))
        last = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        pos = self._decode_positions()
        self._mask = torch.cat([self._mask, torch.ones((len(tokens), 1), dtype=self._mask.dtype,
                                                       device=self.device)], dim=1)
        logits, self._cache = self._forward(last, self._mask, pos, self._cache, last_only=False)
        self.lens = [n + 1 for n in self.lens]
        return logits

    def keep(self, idx: list[int]) -> None:
        self.lens = [self.lens[i] for i in idx]
        it = torch.tensor(idx, dtype=torch.long, device=self.device)
        self._mask = self._mask.index_select(0, it)
        # Columns that are padding in every remaining row only cost attention time: cut them.
        first_real = int((self._mask.sum(0) > 0).nonzero()[0].item())
        self._mask = self._mask[:, first_real:]
        for li, layer in enumerate(self._cache.layers):
            self._cache.layers[li] = SlabLayer(layer.keys.index_select(0, it)[:, :, first_real:, :],
                                               layer.values.index_select(0, it)[:, :, first_real:, :])

    def clear(self) -> None:
        self._cache, self._mask, self.lens = None, None, []


@functools.cache  # one class per process, built on first use: transformers is imported lazily
def _slab_layer_cls():
    from transformers.cache_utils import DynamicLayer

    class _SlabLayer(DynamicLayer):
        """A KV layer in a preallocated slab: a decode step writes in place instead of ``torch.cat``-ing
        the whole cache (which copies every cached token, every layer, every step)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = 64):
            super().__init__()
            b, h, n, d = keys.shape
            self._k = keys.new_empty((b, h, n + headroom, d))
            self._v = values.new_empty((b, values.shape[1], n + headroom, values.shape[3]))
            self._k[:, :, :n] = keys
            self._v[:, :, :n] = values
            self._n = n
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True
            self._expose()

        def _expose(self) -> None:
            self.keys = self._k[:, :, : self._n]
            self.values = self._v[:, :, : self._n]

        def update(self, key_states, value_states, *args, **kwargs):
            m = key_states.shape[-2]
            if self._n + m > self._k.shape[2]:
                grow = max(m, self._k.shape[2])
                self._k = torch.cat([self._k, self._k.new_empty(self._k.shape[:2] + (grow, self._k.shape[3]))], 2)
                self._v = torch.cat([self._v, self._v.new_empty(self._v.shape[:2] + (grow, self._v.shape[3]))], 2)
            self._k[:, :, self._n: self._n + m] = key_states
            self._v[:, :, self._n: self._n + m] = value_states
            self._n += m
            self._expose()
            return self.keys, self.values

    return _SlabLayer


def SlabLayer(keys: torch.Tensor, values: torch.Tensor):  # noqa: N802 - acts as a class
    return _slab_layer_cls()(keys, values)


def _lpad(t: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    """Left-pad ``t`` with zeros along ``dim`` to ``length``."""
    extra = length - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
