"""Scoring RL samples with a trained reward model (``workflow.reward_model``), in the trainer before the
advantages.

The reward model is an ``algo=rm`` export loaded as a forward-only critic engine beside the actor. A sampled
row (prompt + completion, as the rollout built it) is scored the way ``algo=rm`` scored a pair's side
(data/preferences.py renders prompt and side with the chat template, trainer/rm.py appends a read token):

* a trailing end-of-sequence token is taken off the completion and the chat template's own close of an
  assistant turn is appended (``<|im_end|>\\n`` for ChatML), so the text reads as a rendered chat turn whether
  the completion stopped or hit the length limit; without a chat template the completion is plain text;
* one read token follows, and the row's reward is the value at it: the head on the last text token
  (:func:`areal_cli.algorithms.reward_model.sequence_rewards`).

The row holds the prompt and the completion only: the reference answer never reaches the reward model. The
score then combines with the workflow's rule reward (:func:`combine_rewards`), and the batch's ``rewards``
become the combination; ``rule_rewards`` keeps the rule's. ``correct`` (the rule's verdict) is left alone, so
``reward/accuracy`` and the held-out evaluation stay the task's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from areal_cli.algorithms.reward_model import read_batch, sequence_rewards

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.config.workflow import RewardModelConfig

Batch = dict[str, torch.Tensor]
RULE_KEY = "rule_rewards"
SCORE_KEY = "rm_scores"
_MARK = "\x00AREAL_RM_MARK\x00"


def combine_rewards(rule: torch.Tensor, score: torch.Tensor, combine: str, weight: float,
                    rule_weight: float) -> torch.Tensor:
    """The reward a row trains on (config/workflow.py ``RM_COMBINES``): ``rm_only`` → ``weight·score``;
    ``sum`` → ``rule_weight·rule + weight·score``; ``gate`` → that sum where ``rule > 0``, else
    ``rule_weight·rule``."""
    rule, score = rule.float(), score.float()
    if combine == "rm_only":
        return weight * score
    total = rule_weight * rule + weight * score
    if combine == "sum":
        return total
    if combine == "gate":
        return torch.where(rule > 0, total, rule_weight * rule)
    raise ValueError(f"unknown workflow.reward_model.combine {combine!r}")


def score_moments(score: torch.Tensor, rule: torch.Tensor, reduce: Any | None = None) -> tuple[float, float, float, float]:
    """``(n, mean, std, rule mean)`` of the step's rows; ``reduce`` sums over the data-parallel ranks, each
    holding a share of the batch (one collective for the normalisation and the stats alike)."""
    s = score.double()
    sums = torch.stack([torch.tensor(float(s.numel()), dtype=torch.float64), s.sum(), (s * s).sum(),
                        rule.double().sum()])
    if reduce is not None:
        sums = reduce(sums)
    n = max(float(sums[0]), 1.0)
    mean = float(sums[1]) / n
    return n, mean, max(float(sums[2]) / n - mean * mean, 0.0) ** 0.5, float(sums[3]) / n


def normalize_scores(score: torch.Tensor, how: str, n: float, mean: float, std: float,
                     eps: float = 1e-6) -> torch.Tensor:
    """``none``: as is; ``batch``: ``(score - mean) / (std + eps)`` over the step's rows (the moments of
    :func:`score_moments`; ``std`` unbiased here)."""
    if how == "none":
        return score
    if how != "batch":
        raise ValueError(f"unknown workflow.reward_model.normalize {how!r}")
    unbiased = std * (n / max(n - 1.0, 1.0)) ** 0.5
    return ((score.double() - mean) / (unbiased + eps)).to(score.dtype)


def turn_close_ids(tokenizer: Any, use_chat_template: bool) -> list[int]:
    """The token ids the chat template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``);
    [] without a template (``algo=rm`` then reads plain prompt + text)."""
    if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
        return []
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}],
                                         tokenize=False)
    if _MARK not in text:
        return []
    tail = text.split(_MARK, 1)[1]
    return list(tokenizer(tail, add_special_tokens=False)["input_ids"]) if tail else []


def rm_rows(batch: Batch, close_ids: list[int], eos_id: int | None, read_id: int) -> Batch:
    """Right-padded rows for the reward model: each row's real tokens (``attention_mask``), a trailing eos off,
    ``close_ids`` and the read token on."""
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    rows = []
    for i in range(ids.shape[0]):
        toks = ids[i][attn[i]].tolist()
        if eos_id is not None and toks and toks[-1] == eos_id:
            toks = toks[:-1]
        rows.append(toks + list(close_ids) + [int(read_id)])
    return read_batch(rows, read_id)


class RewardModelScorer:
    """Scores a (local) RL batch with a forward-only critic engine and combines the score with the rule
    reward. Collective over the trainer's ranks (the engine's forward), like the teacher's."""

    def __init__(self, cfg: "RewardModelConfig", engine: Any, tokenizer: Any, *, use_chat_template: bool,
                 read_id: int, reduce: Any | None = None):
        self.cfg, self.engine, self.reduce = cfg, engine, reduce
        self.close_ids = turn_close_ids(tokenizer, use_chat_template)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self.read_id = int(read_id)

    @torch.no_grad()
    def scores(self, batch: Batch) -> torch.Tensor:
        rows = rm_rows(batch, self.close_ids, self.eos_id, self.read_id)
        values = self.engine.forward(rows, output="values")["values"]
        return sequence_rewards(values, rows["attention_mask"]).float().cpu()

    def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``batch`` (changed in place) with ``rewards`` the combination, ``rule_rewards`` the rule's and ``rm_scores`` the reward
        model's raw scores; stats ``reward/rm_mean`` (raw), ``reward/rule_mean`` over every replica's rows."""
        c = self.cfg
        raw = self.scores(batch)
        rule = batch["rewards"].float().cpu()
        n, mean, std, rule_mean = score_moments(raw, rule, self.reduce)
        score = normalize_scores(raw, c.normalize, n, mean, std)
        combined = combine_rewards(rule, score, c.combine, c.weight, c.rule_weight)
        stats = {"reward/rm_mean": mean, "reward/rule_mean": rule_mean, "reward/rm_std": std}
        # In place: the step's reward stats (trainer/rl.py _batch_stats) then describe the reward trained on.
        batch[RULE_KEY] = batch["rewards"]
        batch[SCORE_KEY] = raw.to(batch["rewards"].device)
        batch["rewards"] = combined.to(device=batch["rewards"].device, dtype=batch["rewards"].dtype)
        return batch, stats
