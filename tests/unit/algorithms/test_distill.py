"""On-policy distillation's advantage (algorithms/distill.py) and its wiring in PPOActor."""

from __future__ import annotations

import pytest
import torch
from test_actor import REWARDS, SEQS, BigramEngine, make_batch

from areal_cli.algorithms.actor import PPOActor
from areal_cli.algorithms.distill import distill_advantages, mix_advantages
from areal_cli.config.algo import AlgoConfig, DistillConfig
from areal_cli.algorithms.config_checks import validate_algo_config
from areal_cli.errors import ConfigError


def test_advantage_is_coef_times_teacher_minus_student_on_loss_positions():
    teacher = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    student = torch.tensor([[0.0, -3.0, -1.0, -0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, stats = distill_advantages(teacher, student, mask, coef=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0, -0.5, 0.0]]))
    # reverse KL k1 estimate, student - teacher, over the two loss tokens: (-2 + 1) / 2
    assert stats["distill/reverse_kl"] == pytest.approx(-0.5)
    assert stats["distill/teacher_logp"] == pytest.approx(-1.5)
    assert stats["distill/student_logp"] == pytest.approx(-2.0)
    assert stats["distill/adv_abs_mean"] == pytest.approx(0.75)


def test_clamp_bounds_the_difference_but_not_the_reported_kl():
    teacher = torch.tensor([[-30.0, -1.0]])
    student = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    adv, stats = distill_advantages(teacher, student, mask, coef=2.0, clamp=10.0)
    torch.testing.assert_close(adv, torch.tensor([[-20.0, 0.0]]))
    assert stats["distill/reverse_kl"] == pytest.approx(14.5)
    adv, _ = distill_advantages(teacher, student, mask, coef=1.0, clamp=0.0)
    assert adv[0, 0].item() == pytest.approx(-29.0)


def test_mix_weight_zero_is_pure_distillation_and_one_adds():
    task = torch.tensor([[5.0, 5.0, 5.0]])
    dist = torch.tensor([[0.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    torch.testing.assert_close(mix_advantages(task, dist, mask, 0.0), torch.tensor([[0.0, 1.0, -1.0]]))
    torch.testing.assert_close(mix_advantages(task, dist, mask, 1.0), torch.tensor([[0.0, 6.0, 4.0]]))
    torch.testing.assert_close(mix_advantages(task, dist, mask, 0.5), torch.tensor([[0.0, 3.5, 1.5]]))


def _distill_cfg(**kw) -> AlgoConfig:
    return AlgoConfig(distill=DistillConfig(teacher_path="/teacher", **kw))


def test_actor_needs_a_teacher_engine():
    with pytest.raises(ConfigError, match="algo.distill.teacher_path"):
        PPOActor(_distill_cfg(), BigramEngine(), group_size=2)


def test_actor_pure_distillation_uses_teacher_logp_and_moves_student_toward_teacher():
    student, teacher = BigramEngine(seed=0), BigramEngine(seed=1)
    batch = make_batch(student, REWARDS, SEQS)
    actor = PPOActor(_distill_cfg(coef=1.0), student, group_size=2, teacher_engine=teacher)
    out = actor.compute_advantages(batch)
    mask = batch["loss_mask"]
    t_logp = teacher.forward(batch)["logprobs"] * mask
    torch.testing.assert_close(out["teacher_logp"], t_logp)
    # pure distillation: the task's rewards (1, 0, 0, 1) do not enter; behaviour logprobs are the student's
    torch.testing.assert_close(out["advantages"], (t_logp - batch["logprobs"]) * mask)
    assert out["advantages"].abs().sum() > 0
    kl_before = actor.adv_stats["distill/reverse_kl"]
    assert kl_before == pytest.approx(((batch["logprobs"] - t_logp) * mask).sum().item() / mask.sum().item())
    for _ in range(20):
        actor.ppo_update(actor.compute_advantages(make_batch(student, REWARDS, SEQS)))
    actor.compute_advantages(make_batch(student, REWARDS, SEQS))
    # on these sampled tokens the student's logp - teacher's logp shrinks towards 0
    assert abs(actor.adv_stats["distill/reverse_kl"]) < abs(kl_before) * 0.5, (kl_before, actor.adv_stats)


def test_actor_mixed_adds_task_advantage_and_prefers_recomputed_logp():
    student, teacher = BigramEngine(seed=0), BigramEngine(seed=1)
    batch = make_batch(student, REWARDS, SEQS)
    batch["logprobs"] = batch["logprobs"] - 0.3 * batch["loss_mask"]  # a stale behaviour policy
    mask = batch["loss_mask"]
    task = PPOActor(AlgoConfig(), student, group_size=2).compute_advantages(batch)["advantages"]
    cfg = AlgoConfig(recompute_logprob=True, distill=DistillConfig(teacher_path="/t", task_reward_weight=1.0,
                                                                   coef=2.0))
    out = PPOActor(cfg, student, group_size=2, teacher_engine=teacher).compute_advantages(batch)
    expect = task + 2.0 * (out["teacher_logp"] - out["prox_logp"]) * mask
    torch.testing.assert_close(out["advantages"], expect)


def test_distillation_needs_an_advantage_loss():
    with pytest.raises(ConfigError, match="algo.distill.teacher_path.*ignores advantages"):
        validate_algo_config(AlgoConfig(policy_loss="sft", adv_estimator="none",
                                        distill=DistillConfig(teacher_path="/t")))


def test_adv_norm_whitens_the_distillation_advantage():
    # The teacher's advantage is mostly one sign (a student sure of tokens its teacher doubts); adv_norm
    # whitens what is trained on, which gives it a baseline.
    from areal_cli.algorithms.normalisation import masked_mean, masked_whiten

    student, teacher = BigramEngine(seed=0), BigramEngine(seed=1)
    batch = make_batch(student, REWARDS, SEQS)
    mask = batch["loss_mask"]
    raw = PPOActor(_distill_cfg(), student, group_size=2, teacher_engine=teacher).compute_advantages(batch)
    cfg = AlgoConfig(adv_norm=True, distill=DistillConfig(teacher_path="/t"))
    out = PPOActor(cfg, student, group_size=2, teacher_engine=teacher).compute_advantages(batch)
    torch.testing.assert_close(out["advantages"], masked_whiten(raw["advantages"], mask))
    assert abs(masked_mean(out["advantages"], mask).item()) < 1e-5
