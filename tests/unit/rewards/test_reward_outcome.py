"""Issue 22 item 8: correctness comes from the reward function, not from ``reward > 0.5``."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import pytest
import torch


from areal_cli.api.io_struct import GenerationConfig
from areal_cli.rewards import AsyncRewardRunner, get_reward_fn
from areal_cli.rollout.workflows.multi_turn import MultiTurnWorkflow
from areal_cli.rollout.workflows.rlvr import RLVRWorkflow

SRC = Path(__file__).resolve().parents[3] / "src" / "areal_cli"


def partial_credit(prompt, completion, answer):
    """A shaped reward whose value says nothing about correctness: a correct answer earns 0.3
    (module-level so the reward worker processes can import it)."""
    from areal_cli.rewards.outcome import Reward

    return Reward(0.3, True) if completion.strip().startswith(str(answer)) else Reward(0.9, False)


def plain_float(prompt, completion, answer):
    return 0.9


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("name,completion,answer,ok", [
    ("numeric", "#### 5", "5", True), ("numeric", "#### 6", "5", False),
    ("exact", "Paris", "Paris", True), ("exact", "Lyon", "Paris", False),
    ("math", r"\boxed{\frac{1}{2}}", "0.5", True), ("math", r"\boxed{3}", "0.5", False),
    ("code", "```python\nprint(int(input()) * 2)\n```", json.dumps({"inputs": ["2"], "outputs": ["4"]}),
     True),
    ("code", "```python\nprint(3)\n```", json.dumps({"inputs": ["2"], "outputs": ["4"]}), False),
])
def test_builtin_rewards_return_their_correctness(name, completion, answer, ok):
    from areal_cli.rewards.outcome import correctness

    got = get_reward_fn(name)("q", completion, answer)
    assert correctness(got) is ok and float(got) == (1.0 if ok else 0.0)


def test_correctness_crosses_the_reward_worker_processes():
    from areal_cli.rewards.outcome import Reward, correctness

    assert pickle.loads(pickle.dumps(Reward(0.3, True))).correct is True
    with AsyncRewardRunner(partial_credit, max_workers=1, timeout_s=60) as runner:
        right, wrong = asyncio.run(runner.score_many([("q", "5", "5"), ("q", "6", "5")]))
    assert (float(right), correctness(right), float(wrong), correctness(wrong)) == (0.3, True, 0.9, False)
    with AsyncRewardRunner(plain_float, max_workers=1, timeout_s=60) as runner:
        assert correctness(asyncio.run(runner("q", "c", "a"))) is None


def test_rlvr_trajectory_carries_the_reward_functions_correctness(fake_engine, tok):
    eng = fake_engine(token_delay=0)
    eos = tok.eos_token_id
    eng.scripted = [tok.encode("5", add_special_tokens=False) + [eos],
                    tok.encode("6", add_special_tokens=False) + [eos]]
    wf = RLVRWorkflow(partial_credit, GenerationConfig(max_new_tokens=4), tok, group_size=2)
    traj = asyncio.run(wf.arun_episode(eng, {"prompt": "2+3?", "answer": "5"}))
    assert traj.data["rewards"].tolist() == pytest.approx([0.3, 0.9])
    assert traj.data["correct"].tolist() == [1, 0]  # not reward > 0.5, which says [0, 1]
    # A plain number: correctness unknown (-1), never guessed from the value.
    eng.scripted = [[eos], [eos]]
    traj = asyncio.run(RLVRWorkflow(plain_float, GenerationConfig(max_new_tokens=4), tok, group_size=2)
                       .arun_episode(eng, {"prompt": "2+3?", "answer": "5"}))
    assert traj.data["correct"].tolist() == [-1, -1]


def test_multi_turn_stops_on_the_reward_functions_correctness(fake_engine, tok):
    eng = fake_engine(token_delay=0)
    eos = tok.eos_token_id
    eng.scripted = [tok.encode("5", add_special_tokens=False) + [eos]]
    wf = MultiTurnWorkflow(partial_credit, GenerationConfig(max_new_tokens=4), tok, group_size=1, max_turns=3)
    traj = asyncio.run(wf.arun_episode(eng, {"prompt": "2+3?", "answer": "5"}))
    # 0.3 < success_threshold=1.0, but the reward function said correct: no retry.
    assert traj.data["n_turns"].tolist() == [1] and traj.data["correct"].tolist() == [1]


def test_training_accuracy_counts_the_reward_functions_correctness():
    from areal_cli.trainer import rl

    class OneRank:  # the trainer engine's data-parallel reduction, for a single replica
        dp_world_size = 1

        @staticmethod
        def dp_all_reduce(t):
            return t

    batch = {"rewards": torch.tensor([0.3, 0.9, 0.3, 0.0]), "loss_mask": torch.ones(4, 2, dtype=torch.bool),
             "attention_mask": torch.ones(4, 3, dtype=torch.bool),
             "correct": torch.tensor([1, 0, 1, 0], dtype=torch.int8)}
    stats = rl._batch_stats(batch, OneRank())
    assert stats["reward/accuracy"] == 0.5  # reward > 0.5 would say 0.25
    unknown = dict(batch, correct=torch.full((4,), -1, dtype=torch.int8))
    assert "reward/accuracy" not in rl._batch_stats(unknown, OneRank())


def test_no_hard_coded_correctness_threshold_left():
    for path in ("trainer/rl.py", "trainer/evaluation.py"):
        text = (SRC / path).read_text()
        assert "> 0.5" not in text, path


def test_evaluation_uses_the_reward_functions_correctness(fake_engine, tok, monkeypatch):
    from areal_cli.plan.compose import load_config
    from areal_cli.rollout import build
    from areal_cli.trainer import evaluation

    cfg = load_config(["rollout.gconfig.max_new_tokens=4", "rollout.eval_gconfig.max_new_tokens=4",
                       "trainer.eval_n_samples=2"])
    eos = tok.eos_token_id
    eng = fake_engine(token_delay=0)
    five = tok.encode("5", add_special_tokens=False) + [eos]
    six = tok.encode("6", add_special_tokens=False) + [eos]
    # Greedy: "5" for both items (right, reward 0.3). Samples: item 1 "6", "5"; item 2 "6", "6"
    # (a wrong "6" earns 0.9).
    eng.scripted = [five, five, six, five, six, six]
    monkeypatch.setattr(build, "build_client", lambda *a, **k: eng)  # the servers are not under test
    items = [{"prompt": "2+3?", "answer": "5"}, {"prompt": "2+3?", "answer": "5"}]
    out = evaluation.evaluate_on_servers(cfg, ["unused:0"], "hf", tok, items, reward_fn=partial_credit,
                                         concurrency=1)
    assert out["eval/pass@1"] == 1.0  # reward > 0.5 said 0.0
    assert out["eval/pass@2"] == 0.5 and out["eval/mean@2"] == 0.25  # reward > 0.5 said 1.0 and 0.75
    out = evaluation.evaluate_on_servers(cfg, ["unused:0"], "hf", tok, items[:1], reward_fn=plain_float,
                                         concurrency=1)
    assert "eval/pass@1" not in out and out["eval/reward_mean"] == pytest.approx(0.9)
