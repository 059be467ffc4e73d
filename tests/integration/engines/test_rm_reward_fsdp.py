"""``workflow.reward_model`` on the real FSDP engine (one CPU process): the trainer's step scores every row with
a reward-model export and trains on the combination; the scores equal ``AutoModelForSequenceClassification``'s
from the same export (plus the head's bias, which the classifier leaves out), computed from the rendered chat
text, not from the rows the scorer builds."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.engines  # a trainer step on the real engine, ~13 s: CI runs it in the engines phase


def make_rm_export(src: str, dst) -> str:
    """A critic export of the tiny model (backbone + a random value head), made loadable as a classifier the
    way ``algo=rm`` exports are (trainer/reward_export.py)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from areal_cli.trainer.reward_export import write_sequence_classification

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)
    hidden = json.loads((dst / "config.json").read_text())["hidden_size"]
    save_file({"weight": 0.1 * torch.randn(1, hidden, generator=g), "bias": torch.tensor([0.25])},
              str(dst / "value_head.safetensors"))
    tok = AutoTokenizer.from_pretrained(src)
    assert write_sequence_classification(str(dst), tok.pad_token_id if tok.pad_token_id is not None
                                         else tok.eos_token_id)
    return str(dst)


def classifier_scores(rm_dir: str, texts: list[str]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    bias = json.loads(open(f"{rm_dir}/reward_model.json").read())["value_head_bias"]
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out.append(float(model(input_ids=ids).logits[0, 0]) + bias)
    return torch.tensor(out)


@pytest.mark.parametrize("combine", ["rm_only", "sum", "gate"])
def test_trainer_step_trains_on_reward_model_scores(tiny_model_dir, tmp_path, combine):
    from transformers import AutoTokenizer

    from areal_cli.algorithms.actor import PPOActor
    from areal_cli.algorithms.rm_reward import combine_rewards
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import AlgoConfig, OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.engines.fsdp import FSDPEngine
    from areal_cli.job.layout import JobLayout
    from areal_cli.trainer import build
    from areal_cli.trainer.rl import _ppo_step

    rm_dir = make_rm_export(tiny_model_dir, tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template  # the rows are scored as rendered chat turns
    questions = ["What is 3+4?", "What is 10+2?"]
    answers = [["3+4=7\n#### 7", "3+4=8\n#### 8", "7", "3+4="], ["10+2=12\n#### 12", "12", "10+2=13", "#### 1"]]
    ended = [True, True, False, True]  # the third completion of a group hit the length limit: no eos
    rows, texts = [], []
    for q, group in zip(questions, answers):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for a, stop in zip(group, ended):
            c_ids = tok(a, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if stop else [])
            rows.append((p_ids, c_ids))
            texts.append(tok.apply_chat_template([{"role": "user", "content": q},
                                                  {"role": "assistant", "content": a}], tokenize=False))
    width = max(len(p) + len(c) for p, c in rows)
    B = len(rows)
    ids = torch.full((B, width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.bool)
    mask = torch.zeros(B, width)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = True
        mask[i, len(p): len(p) + len(c)] = 1
    rule = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])

    cfg = ExperimentConfig()
    cfg.workflow.reward_model.path = rm_dir
    cfg.workflow.reward_model.combine = combine
    cfg.workflow.reward_model.weight = 2.0
    cfg.workflow.reward_model.rule_weight = 1.0 if combine == "rm_only" else 0.5
    policy = FSDPEngine(EngineConfig(), OptimConfig(lr=1e-3), total_steps=4)
    policy.initialize(ParallelStrategy(), tiny_model_dir)
    scorer = build.build_reward_model(cfg, JobLayout(), tiny_model_dir, tok, peers=(policy,))
    assert scorer.engine.optimizer is None  # forward-only: no optimizer state beside the actor

    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "rewards": rule.clone(),
             "versions": torch.where(mask.bool(), 0, -1)}
    batch["logprobs"] = policy.forward(batch)["logprobs"] * mask
    actor = PPOActor(AlgoConfig(), policy, group_size=4)
    stats = _ppo_step(actor, None, batch, scorer)

    expected_scores = classifier_scores(rm_dir, texts)
    torch.testing.assert_close(batch["rm_scores"], expected_scores, atol=1e-4, rtol=1e-4)
    r = cfg.workflow.reward_model
    expected = combine_rewards(rule, expected_scores, combine, r.weight, r.rule_weight)
    torch.testing.assert_close(batch["rewards"], expected, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(batch["rule_rewards"], rule)
    assert stats["reward/rm_mean"] == pytest.approx(float(expected_scores.mean()), abs=1e-4)
    assert stats["reward/rule_mean"] == pytest.approx(float(rule.mean()))
    # the advantages came from the combined reward: GRPO's group-normalised combination, on every token
    adv = actor.compute_advantages(batch)["advantages"]
    grp = expected.view(2, 4)
    want = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-6)).view(-1)
    got = (adv * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    scorer.engine.destroy()
    policy.destroy()
