"""Reward-model training: the Bradley–Terry loss on preference pairs, on any engine with a value head.

A reward model is a critic engine (``critic=True``: a ``Linear(hidden, 1)`` head in the LM head's place)
whose scalar for a sequence is the head on the hidden state of the sequence's last token. The engines give
per-token values shifted like logprobs (entry ``i`` reads the hidden state of token ``i - 1``), so a
preference batch appends one *read token* to every sequence: the value at the row's last position is then
the head on the last text token, what ``AutoModelForSequenceClassification`` pools (checkpoints/export
writes the head as its ``score``).

The loss of a pair is Bradley–Terry's ``-log σ(r_chosen - r_rejected)``, averaged over the pairs. Engines
split a batch into micro-batches by a token budget and over data-parallel ranks, which can put the two
sides of a pair apart; so a step runs in two passes that give the exact gradient whatever the split:

1. a no-grad forward reads every row's reward, and the pair loss gives each row its coefficient
   ``c = ∂loss/∂r`` (``-σ(-(r_c - r_r)) / n_pairs`` for chosen, the opposite for rejected);
2. ``train_batch`` minimises the surrogate ``Σ c·r`` (``c`` a constant): its gradient is the pair loss's.

The cost is one extra forward per step (a third of a step's compute). Pure tensor code apart from
:func:`rm_step`, which drives a ``TrainEngine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.engine_api import TrainEngine

Batch = dict[str, torch.Tensor]
COEF_KEY = "rm_coef"  # per row [B]: ∂(mean pair loss)/∂reward, the surrogate's constant
SHARE_KEY = "rm_share"  # per row [B]: 1 / (2 · pairs in the step), so a step's weights sum to 1


def read_token_id(tokenizer: Any) -> int:
    """The token appended to every side (its value is the sequence's reward): the pad token, else eos. Its id
    never changes the reward: causal attention keeps it out of the text."""
    tid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(tid if tid is not None else 0)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean ``-log σ(r_chosen - r_rejected)`` over the pairs, with stats: ``accuracy`` (share of pairs
    with ``r_chosen > r_rejected``; a tie counts as wrong), ``margin`` (mean ``r_chosen - r_rejected``),
    ``chosen``/``rejected`` (mean rewards)."""
    if r_chosen.shape != r_rejected.shape or r_chosen.dim() != 1:
        raise ValueError(f"need two [n_pairs] reward vectors, got {tuple(r_chosen.shape)} and "
                         f"{tuple(r_rejected.shape)}")
    diff = r_chosen.float() - r_rejected.float()
    loss = -F.logsigmoid(diff).mean()
    return loss, {"loss": float(loss.detach()), "accuracy": float((diff > 0).float().mean()),
                  "margin": float(diff.detach().mean()), "chosen": float(r_chosen.detach().float().mean()),
                  "rejected": float(r_rejected.detach().float().mean())}


def sequence_rewards(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's value at its last real position (the head on the token before the read token)."""
    last = attention_mask.long().sum(dim=1) - 1
    if bool((last < 1).any()):
        raise ValueError("a preference row needs at least one text token and the read token")
    return values.float()[torch.arange(values.shape[0]), last.to(values.device)]


def make_pair_batch(pairs: list[dict[str, Any]], read_token_id: int, pad_token_id: int = 0) -> Batch:
    """Right-padded rows ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``, each the side's token ids
    plus ``read_token_id``; ``loss_mask`` marks the read position (the only value the loss reads)."""
    rows = []
    for p in pairs:
        rows += [list(p["chosen_ids"]) + [read_token_id], list(p["rejected_ids"]) + [read_token_id]]
    return read_batch(rows, pad_token_id)


def read_batch(rows: list[list[int]], pad_token_id: int) -> Batch:
    """Rows that each end on the read token, right-padded with ``pad_token_id``; ``loss_mask`` marks each
    row's last real position, where the reward is read."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.bool)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, : len(r)] = True
        mask[i, len(r) - 1] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}


def pair_rewards(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) from the interleaved rows of :func:`make_pair_batch`."""
    return rewards[0::2], rewards[1::2]


def row_coefficients(rewards: torch.Tensor, n_pairs_total: float) -> torch.Tensor:
    """``∂ mean-pair-loss / ∂ r`` per interleaved row, the mean over ``n_pairs_total`` pairs (all
    data-parallel ranks' pairs): the surrogate ``Σ c·r`` has the pair loss's gradient."""
    rc, rr = pair_rewards(rewards.float())
    g = -torch.sigmoid(rr - rc) / float(n_pairs_total)  # ∂/∂r_c of -log σ(r_c - r_r); ∂/∂r_r is -g
    coef = torch.empty_like(rewards, dtype=torch.float32)
    coef[0::2], coef[1::2] = g, -g
    return coef


def surrogate_loss_fn(outputs: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Per micro-batch: ``Σ c·r`` divided by the micro-batch's weight (the engine scales by weight/global
    weight, and the global weight is 1 by :func:`surrogate_weight_fn`); the coefficients already hold the
    mean over pairs."""
    r = sequence_rewards(outputs["values"], mb["attention_mask"])
    return (mb[COEF_KEY].to(r.device).float() * r).sum() / surrogate_weight_fn(mb), {}


def surrogate_weight_fn(mb: Batch) -> float:
    # Each row's share of one unit: weights sum to 1 over the step, so the engine's rescaling is a no-op
    # and the coefficients' own 1/n_pairs normalises the gradient.
    return float(mb[SHARE_KEY].sum())


def rm_step(engine: "TrainEngine", batch: Batch, n_pairs_total: int, *, train: bool = True) -> dict[str, float]:
    """One reward-model step on this replica's pairs (``batch`` from :func:`make_pair_batch`; every rank of
    a replica passes the replica's rows). Returns the pair stats over every data-parallel rank's pairs
    (``rm/loss`` is the Bradley–Terry loss before the update) and, when ``train``, ``grad_norm`` and ``lr``."""
    rewards = sequence_rewards(engine.forward(batch, output="values")["values"], batch["attention_mask"])
    stats = pair_stats(engine, rewards)
    if train:
        share = torch.full((rewards.shape[0],), 1.0 / (2 * n_pairs_total), dtype=torch.float64)
        rows = {**batch, COEF_KEY: row_coefficients(rewards, n_pairs_total), SHARE_KEY: share}
        out = engine.train_batch(rows, surrogate_loss_fn, surrogate_weight_fn)
        stats.update({"rm/grad_norm": out.get("grad_norm"), "rm/lr": out.get("lr")})
    return stats


def pair_stats(engine: Any, rewards: torch.Tensor) -> dict[str, float]:
    """Bradley–Terry stats over every data-parallel rank's pairs (sums reduced with ``dp_all_reduce``)."""
    rc, rr = pair_rewards(rewards.float())
    diff = rc - rr
    sums = torch.tensor([float(rc.numel()), float(-F.logsigmoid(diff).sum()), float((diff > 0).sum()),
                         float(diff.sum()), float(rc.sum()), float(rr.sum())], dtype=torch.float64)
    if engine is not None and getattr(engine, "dp_world_size", 1) > 1:
        sums = engine.dp_all_reduce(sums)
    n = max(float(sums[0]), 1.0)
    return {"rm/loss": float(sums[1]) / n, "rm/accuracy": float(sums[2]) / n, "rm/margin": float(sums[3]) / n,
            "rm/chosen": float(sums[4]) / n, "rm/rejected": float(sums[5]) / n, "rm/pairs": float(sums[0])}
