"""PPOActor / PPOCritic / sft_step driving the real FSDP engine (one CPU process) on the tiny Qwen2."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines.fsdp import FSDPEngine

    def make(critic=False, lr=1e-2):
        e = FSDPEngine(EngineConfig(), OptimConfig(lr=lr), total_steps=10, critic=critic)
        e.initialize(ParallelStrategy(), tiny_model_dir)
        return e

    return make


def make_batch(engine, B=8, P=4, L=10):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (B, L), generator=g)
    mask = torch.zeros(B, L)
    mask[:, P:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, L, dtype=torch.bool), "loss_mask": mask,
             "rewards": torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0]), "versions": torch.where(mask.bool(), 0, -1)}
    batch["logprobs"] = engine.forward(batch)["logprobs"] * mask
    return batch


def test_actor_critic_sft_on_fsdp(engines):
    from areal_cli.algorithms.actor import PPOActor, sft_step
    from areal_cli.algorithms.critic import PPOCritic
    from areal_cli.config.algo import AlgoConfig

    policy = engines()
    batch = make_batch(policy)
    mask = batch["loss_mask"]
    before = (policy.forward(batch)["logprobs"] * mask).sum(-1)
    actor = PPOActor(AlgoConfig(), policy, group_size=4)
    out = actor.compute_advantages(batch)
    stats = actor.ppo_update(out)
    after = (policy.forward(batch)["logprobs"] * mask).sum(-1)
    adv = out["advantages"].sum(-1)
    assert ((after - before).sign() == adv.sign()).all()
    assert stats["importance_ratio"] == pytest.approx(1.0, abs=1e-4)  # on-policy: recomputed == behaviour

    ref = engines()
    kl_actor = PPOActor(AlgoConfig(kl_coef=0.1, kl_estimator="k3"), policy, ref_engine=ref, group_size=4)
    assert kl_actor.ppo_update(kl_actor.compute_advantages(batch))["kl"] > 0

    cfg = AlgoConfig(adv_estimator="gae", use_critic=True, lam=0.95)
    critic = PPOCritic(cfg, engines(critic=True, lr=1e-3))
    gae_actor = PPOActor(cfg, policy, group_size=4)
    b = gae_actor.compute_advantages(critic.compute_values(batch))
    assert torch.isfinite(torch.tensor(list(critic.ppo_update(b).values()))).all()

    nll = [sft_step(policy, batch)["nll"] for _ in range(3)]
    assert nll[-1] < nll[0]
