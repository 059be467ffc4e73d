"""The hf server's earlier rollout code paths, kept here as benchmark baselines (not in the product).

- independent prefill: every request is prefilled on its own, also when its prompt equals one already in
  the batch (the server shares that prefill: ``GenerationEngine._prefill_shared``);
- generator sampling: a seeded row draws with its own ``torch.Generator`` + ``multinomial`` (the server
  draws one vectorised counter-based uniform per row, ``sampling.seeded_uniform``; it picks other tokens).

``python benchmarks/hf_baseline.py [--no-shared-prefill] [--seeded-sampling generator] <hf_server args>``
runs the built-in server with those paths; :func:`launch_baseline_server` starts it like
``areal_cli.inference.launch.launch_server`` starts the real one, and :func:`launch` picks between
them. Used by ``rollout_batch.py`` and by the tests that compare the paths
(``tests/unit/inference/test_hf_fastpath.py``, ``tests/integration/inference/test_hf_server_paths.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch

from areal_cli.inference.server import engine as engine_mod
from areal_cli.inference.server import sampling

BASELINE_FLAGS = ("--no-shared-prefill", "--seeded-sampling")


class IndependentPrefillEngine(engine_mod.GenerationEngine):
    """The engine with the shared-prompt prefill replaced by one prefill per request."""

    def _prefill_shared(self, batch: list[engine_mod.Sequence]) -> None:
        # A resumed request's earlier output is part of its prompt here (it is in the KV cache).
        seqs = [s.prompt_ids + s.out_ids for s in batch]
        self._set_row_adapters(batch)
        routed = self._capture_for(batch)
        logits = self.runner.prefill(seqs)
        rt = self._take_routing(len(seqs)) if routed else None
        for i, (s, x) in enumerate(zip(batch, seqs)):
            s.real_len = len(x)
            if rt is not None and s.record_routing:  # rows are left-padded: the last len(x) columns
                s.routing.append(rt[i, rt.shape[1] - len(x):])
        self.stats["prefill_tokens"] += sum(len(x) for x in seqs)
        self._running.extend(batch)
        self._sample_and_append(logits, rows=list(range(len(self._running) - len(batch), len(self._running))))


def sample_generator(probs: torch.Tensor, params: list, greedy_rows: list[bool], pos: list[int],
                     generator: torch.Generator) -> torch.Tensor:
    """The original scheme: a global multinomial, then one seeded Generator + multinomial per seeded row
    (same signature as ``sampling._sample_hash``, which it replaces)."""
    next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    for i, p in enumerate(params):
        if p.sampling_seed is not None and not greedy_rows[i]:
            g = torch.Generator().manual_seed((p.sampling_seed * 1_000_003 + pos[i]) % (2**63))
            next_ids[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return next_ids


@contextlib.contextmanager
def generator_sampling() -> Iterator[None]:
    """``sampling.sample_next`` draws seeded rows the original way inside this block."""
    saved = sampling._sample_hash
    sampling._sample_hash = sample_generator
    try:
        yield
    finally:
        sampling._sample_hash = saved


def split_flags(argv: list[str]) -> tuple[bool, bool, list[str]]:
    """``(shared_prefill, hash_sampling, the hf server's own args)`` from a command line."""
    shared, hashed, rest = True, True, []
    it = iter(argv)
    for a in it:
        if a == "--no-shared-prefill":
            shared = False
        elif a == "--seeded-sampling":
            hashed = next(it) == "hash"
        else:
            rest.append(a)
    return shared, hashed, rest


def main(argv: list[str] | None = None) -> int:
    from areal_cli.inference import hf_server

    shared, hashed, rest = split_flags(list(sys.argv[1:] if argv is None else argv))
    if not shared:  # hf_server.main imports the class from this module when it builds the engine
        engine_mod.GenerationEngine = IndependentPrefillEngine
    with contextlib.nullcontext() if hashed else generator_sampling():
        return hf_server.main(rest)


def launch_baseline_server(model_path: str, *, log_dir: str | None = None, timeout_s: float = 180.0,
                           env: dict[str, str] | None = None, extra: list[str] | tuple[str, ...] = ()):
    """Like ``launch_server("hf", ...)``, running this module instead of the server's: ``extra`` may hold
    the baseline flags next to the server's own."""
    from areal_cli.inference.launch import launch_server

    return launch_server("hf", model_path, log_dir=log_dir, timeout_s=timeout_s, env=env,
                         script=os.path.abspath(__file__), extra=list(extra))


def launch(model_path: str, extra: list[str] | tuple[str, ...] = (), **kw):
    """The real server when ``extra`` names no baseline path, else the baseline one."""
    if any(a in BASELINE_FLAGS for a in extra):
        return launch_baseline_server(model_path, extra=extra, **kw)
    from areal_cli.inference.launch import launch_server

    return launch_server("hf", model_path, extra=list(extra), **kw)


if __name__ == "__main__":
    sys.exit(main())
