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
                positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns ``(token_ids [B], logprobs [B])``.

    Logprobs are ``log_softmax(logits / T)`` at the chosen token, before top-k/top-p truncation
    (``T = 1`` for greedy rows). ``min_new_tokens`` masks stop tokens for sampling only.
    Rows with ``sampling_seed`` draw from a generator seeded by (seed, absolute position in
    ``positions``, else ``n_generated``), so a request resumed as prompt + tokens-so-far continues
    the same random stream.
    """
    logits = logits.float()
    vocab = logits.shape[1]
    greedy_rows = [p.greedy for p in params]
    temps = [1.0 if g else p.temperature for g, p in zip(greedy_rows, params)]
    # The common RL case (every row T=1, no truncation) skips the division and the second softmax.
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps).unsqueeze(1)
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

    if all(greedy_rows):
        next_ids = work.argmax(dim=-1)
    else:
        top_k = [p.top_k if p.top_k and 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(x < 1.0 for x in top_p):
            work = _truncate(work, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32))
        # exp(log_softmax) is the softmax; reuse it unless rows were masked or truncated above.
        probs = logprobs.exp() if work is scaled else torch.softmax(work, dim=-1)
        next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        for i, p in enumerate(params):
            if p.sampling_seed is not None and not greedy_rows[i]:
                # Seeded from (seed, position): independent of batch composition and arrival order.
                pos = positions[i] if positions is not None else n_generated[i]
                g = torch.Generator().manual_seed((p.sampling_seed * 1_000_003 + pos) % (2**63))
                next_ids[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        if any(greedy_rows):
            next_ids = torch.where(torch.tensor(greedy_rows), work.argmax(dim=-1), next_ids)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    return next_ids, chosen


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (the top token always survives)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1]).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before this token
    remove |= before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
