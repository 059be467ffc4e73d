"""``auto`` sizes chosen from the memory model (allocation/estimate.py), with a margin.

``engine.max_tokens_per_mb=auto``: the largest micro-batch token budget whose estimated per-device training
memory fits ``MEMORY_MARGIN`` × the device, a whole number of sequences (prompt + new tokens), at least one, and
no more than a minibatch per data-parallel rank (a larger budget packs nothing more; under pipeline parallelism
no more than a minibatch / p, so every stage has a micro-batch to work on).

``rollout.max_concurrent_rollouts=auto``: the episodes the servers' KV cache holds with the same margin (each
episode decodes its whole group at once, the prompt cached once), capped by the staleness bound (more can never be
admitted), and by the servers' own cap where every backend's spec declares one (``max_concurrency``: the built-in
hf server's 64).

Pure arithmetic, no torch: ``plan/validate.py`` calls it once and writes the numbers into the config, so the
run's config.yaml and every engine see ints, never ``auto``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

# The hf server's cap lives in its spec (inference/backends/hf.py); the name stays for its readers.
from areal_cli.inference.backends.hf import MAX_CONCURRENCY as HF_CONCURRENCY  # noqa: F401

AUTO = "auto"
# The estimates are good to ~20% (estimate.py) and leave out what no formula here counts: the CUDA context
# and NCCL buffers, the caching allocator's fragmentation, temporaries of the loss. Filling 85% of the device
# keeps that headroom and still uses most of it.
MEMORY_MARGIN = 0.85


@dataclass
class AutoChoice:
    """What ``auto`` resolved to, for ``validate-config`` (human and ``--json``)."""

    path: str  # the config key, e.g. engine.max_tokens_per_mb
    value: int
    bound: str  # what limited it: "memory", "minibatch", "staleness", "<backend> cap"
    detail: str  # one line: the estimate and the limit

    def to_dict(self) -> dict:
        return asdict(self)


def largest_fitting_seqs(total_gb: Callable[[int], float], max_seqs: int, budget_gb: float) -> int:
    """The largest ``k`` in ``1..max_seqs`` with ``total_gb(k) <= budget_gb``, or 0 when even ``k=1`` does not fit.

    ``total_gb(k)``: the estimated per-device memory with micro-batches of ``k`` sequences; it grows with
    ``k`` (activations are linear in the micro-batch's tokens), so a bisection finds the edge."""
    if max_seqs < 1 or total_gb(1) > budget_gb:
        return 0
    lo, hi = 1, max_seqs  # total_gb(lo) fits; find the largest that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total_gb(mid) <= budget_gb:
            lo = mid
        else:
            hi = mid - 1
    return lo


def micro_batch_cap(seqs_per_minibatch: int, pp: int) -> int:
    """Sequences per micro-batch beyond which a bigger budget changes nothing (one micro-batch per
    minibatch), or under pipeline parallelism leaves stages without a micro-batch (fewer than p of them)."""
    return max(1, seqs_per_minibatch // max(1, pp))


def concurrency(kv_tokens: list[tuple[int, int]], episode_tokens: int, staleness_cap: int,
                server_cap: tuple[int, str] | None = None, margin: float = MEMORY_MARGIN) -> tuple[int, str]:
    """``(episodes, what bound it)`` for ``rollout.max_concurrent_rollouts=auto``.

    ``kv_tokens``: ``(KV tokens one instance holds, instances)`` per inference component; ``episode_tokens``:
    the KV one episode needs at its longest (the prompt once, plus group size × new tokens); ``server_cap``:
    ``(episodes, backend)`` the servers themselves take at most, or None."""
    fits = [int(margin * tokens // max(1, episode_tokens)) * n for tokens, n in kv_tokens]
    kv = min(fits) if fits else staleness_cap
    best, bound = kv, "memory"
    if staleness_cap < best:
        best, bound = staleness_cap, "staleness"
    if server_cap is not None and server_cap[0] < best:
        best, bound = server_cap[0], f"{server_cap[1]} cap"
    return max(1, best), bound
