"""Vectorised sampling for a whole batch in one pass (no per-row Python work on the tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` subset the ``hf`` server implements."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 → greedy (SGLang convention)
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None  # per-request seed (SGLang's name); None: the server's RNG

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def sample_next(logits: torch.Tensor, params: list[SamplingParams], n_generated: list[int],
                eos_ids: set[int], generator: torch.Generator,
                positions: list[int] | None = None, *, with_mask: bool = False,
                banned: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Sample one token per row. Returns ``(token_ids [B], logprobs [B])``.

    ``with_mask``: also return ``(cutoffs [B], masked_logprobs [B])`` (Keep-Sampling-Mask): the row's
    top-k/top-p kept set is every token whose ``logits / T`` is ``>= cutoffs[i]`` (``-inf``: nothing was
    cut, greedy rows included), and ``masked_logprobs`` is the chosen token's log-probability under
    that truncated, renormalised distribution (the behaviour policy).

    Logprobs are ``log_softmax(logits / T)`` at the chosen token, before top-k/top-p truncation
    (``T = 1`` for greedy rows). ``min_new_tokens`` masks stop tokens for sampling only, and so does
    ``banned`` (token ids never sampled: a vision-language model's vision tokens, ``vision.vision_token_ids``),
    so the logprobs stay the model's own, what a teacher-forced forward (the trainer's) computes.
    Rows with ``sampling_seed`` draw a token that depends only on (seed, absolute position in
    ``positions``, else ``n_generated``) and the row's probabilities, so a request resumed as
    prompt + tokens-so-far continues the same random stream whatever the batch: one vectorised
    inverse-CDF draw for all seeded rows (see :func:`seeded_uniform`).
    """
    logits = logits.float()
    vocab, dev = logits.shape[1], logits.device  # every helper tensor lives beside the logits (CUDA too)
    greedy_rows = [p.greedy for p in params]
    temps = [1.0 if g else p.temperature for g, p in zip(greedy_rows, params)]
    # The common RL case (every row T=1, no truncation) skips the division and the second softmax.
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=dev).unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)

    work = scaled
    blocked = [i for i, (p, n) in enumerate(zip(params, n_generated)) if n < p.min_new_tokens]
    if blocked:
        work = work.clone()
        for i in blocked:
            stop_ids = [t for t in (set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else eos_ids))
                        if t < vocab]
            if stop_ids:
                work[i, stop_ids] = float("-inf")

    if banned is not None and banned.numel():
        work = work.index_fill(1, banned.to(dev), float("-inf"))

    cutoffs = torch.full((logits.shape[0],), float("-inf"), device=dev)
    if all(greedy_rows):
        next_ids = work.argmax(dim=-1)
    else:
        top_k = [p.top_k if p.top_k and 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(x < 1.0 for x in top_p):
            work, cutoffs = _truncate(work, torch.tensor(top_k, device=dev),
                                      torch.tensor(top_p, dtype=torch.float32, device=dev))
            cutoffs = cutoffs.masked_fill(torch.tensor(greedy_rows, device=dev), float("-inf"))
        # exp(log_softmax) is the softmax; reuse it unless rows were masked or truncated above.
        probs = logprobs.exp() if work is scaled else torch.softmax(work, dim=-1)
        pos = positions if positions is not None else n_generated
        next_ids = _sample_hash(probs, params, greedy_rows, pos, generator)
        if any(greedy_rows):
            next_ids = torch.where(torch.tensor(greedy_rows, device=dev), work.argmax(dim=-1), next_ids)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    if not with_mask:
        return next_ids, chosen
    # Renormalise over the kept set of ``scaled`` (not ``work``: min_new_tokens' stop-token block is not
    # part of the mask the trainer can rebuild; the config refuses that combination).
    kept = scaled.masked_fill(scaled < cutoffs.unsqueeze(1), float("-inf"))
    masked = kept.gather(1, next_ids.unsqueeze(1)).squeeze(1) - torch.logsumexp(kept, dim=-1)
    return next_ids, chosen, cutoffs, torch.where(torch.isinf(cutoffs), chosen, masked)


def _sample_hash(probs: torch.Tensor, params: list[SamplingParams], greedy_rows: list[bool],
                 pos: list[int], generator: torch.Generator) -> torch.Tensor:
    """Seeded rows: inverse CDF at a counter-based uniform; the rest: the server generator's multinomial."""
    seeded_rows = [i for i, p in enumerate(params) if p.sampling_seed is not None and not greedy_rows[i]]
    if len(seeded_rows) == len(params):
        return inverse_cdf(probs, seeded_uniform([p.sampling_seed for p in params], pos))
    if not seeded_rows and not any(greedy_rows):  # all rows on the generator: no row gather/scatter
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    dev = probs.device
    next_ids = torch.zeros(len(params), dtype=torch.long, device=dev)  # greedy rows: filled in by the caller
    taken = set(seeded_rows)
    free = [i for i in range(len(params)) if i not in taken and not greedy_rows[i]]
    if free:  # only unseeded sampled rows consume the server generator
        fi = torch.tensor(free, device=dev)
        next_ids[fi] = torch.multinomial(probs.index_select(0, fi), 1, generator=generator).squeeze(1)
    if seeded_rows:
        si = torch.tensor(seeded_rows, device=dev)
        u = seeded_uniform([params[i].sampling_seed for i in seeded_rows], [pos[i] for i in seeded_rows])
        next_ids[si] = inverse_cdf(probs.index_select(0, si), u)
    return next_ids


# splitmix64 (Steele, Lea & Flood 2014) constants, as signed int64 (torch has no uint64 arithmetic).
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_M1 = 0xBF58476D1CE4E5B9 - 2**64
_M2 = 0x94D049BB133111EB - 2**64


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` on a signed tensor is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection on 64-bit words (int64 products wrap modulo 2**64)."""
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def _as_int64(x: int) -> int:
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def seeded_uniform(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` (float64, 53 random bits), a pure function of each ``(seed, position)``.

    ``mix64(mix64(seed + GAMMA) + position * GAMMA)``: hashing the seed first decorrelates
    neighbouring seeds (the trainer seeds samples ``base, base+1, ...``); the position is the counter.
    """
    s = torch.tensor([_as_int64(x) for x in seeds], dtype=torch.int64)
    p = torch.tensor([_as_int64(x) for x in positions], dtype=torch.int64)
    z = _mix64(_mix64(s + _GAMMA) + p * _GAMMA)
    return _srl(z, 11).double() * (1.0 / (1 << 53))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u * total`` (zero-probability
    tokens are never chosen). Float64 cumsum: a row's draw does not depend on rounding of its batch."""
    cdf = probs.double().cumsum(dim=-1)
    x = (u.to(device=cdf.device, dtype=cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    over = idx >= probs.shape[1]  # u * total rounded up to total: the last token with mass
    if bool(over.any()):
        last = probs.shape[1] - 1 - (probs.flip(-1) > 0).long().argmax(dim=-1)
        idx = torch.where(over, last, idx)
    return idx


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask logits outside each row's top-k and top-p nucleus (the top token always survives).

    Returns ``(masked, cutoffs)``. The kept set is a threshold: every token whose logit is ``>=`` the
    smallest kept one, i.e. ``>= cutoffs`` (``-inf`` for rows where nothing is cut). Tokens tied with the last
    kept one are therefore all kept, whatever order ``sort`` put them in, so the trainer can rebuild
    exactly this set from one float per token (Keep-Sampling-Mask), on a vocab shard as well."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before this token
    remove |= before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    # ``before`` is non-decreasing, so the kept tokens are a prefix of the sorted row.
    n_keep = (~remove).sum(dim=-1)
    lowest = sorted_logits.gather(1, (n_keep - 1).unsqueeze(1))
    masked = scaled.masked_fill(scaled < lowest, float("-inf"))
    # The recorded cutoff is the midpoint between the lowest kept and the highest dropped value: the
    # same set here, and the widest margin for the trainer, whose logits differ from these by rounding
    # (a cutoff at the lowest kept value itself dropped that token whenever the trainer's was 1e-8 lower).
    highest_out = sorted_logits.masked_fill(sorted_logits >= lowest, float("-inf")).max(dim=-1).values
    lowest = lowest.squeeze(1)
    mid = lowest / 2 + highest_out / 2
    mid = torch.where((mid > highest_out) & (mid <= lowest), mid, lowest)  # adjacent floats: no room between
    cutoffs = torch.where(torch.isinf(highest_out), torch.full_like(mid, float("-inf")), mid)
    return masked, cutoffs
