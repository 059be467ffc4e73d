"""Issue 22, algorithms: exact-zero advantages for equal rewards, one KL clamp default, DAPO's
overlong penalty per turn, Dr.GRPO's constant normaliser, group-size-1 config errors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_cli.algorithms.advantages import compute_advantages

EQUAL_REWARD_ESTIMATORS = [
    ("grpo", {"mean_level": "group", "std_level": "group"}),
    ("grpo", {"mean_level": "batch", "std_level": "batch"}),
    ("grpo", {"mean_level": "group", "std_level": "batch"}),
    ("drgrpo", {}),
    ("rloo", {}),
    ("reinforce_pp_baseline", {}),
]

_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(value=_finite, group_size=st.integers(2, 64), n_groups=st.integers(1, 4),
       mixed=st.floats(min_value=-5, max_value=5, allow_nan=False, width=32))
def test_equal_rewards_give_exactly_zero_advantages(value, group_size, n_groups, mixed):
    """A group whose rewards are all equal carries no signal: every estimator that centres on a
    group (or batch) mean must give exactly 0, whatever the value (0.7 used to give |A| ~ 0.06)."""
    B = group_size * n_groups
    mask = torch.ones(B, 3)
    rewards = torch.full((B,), value, dtype=torch.float32)
    for name, kw in EQUAL_REWARD_ESTIMATORS:
        adv, _ = compute_advantages(name, rewards=rewards, loss_mask=mask, group_size=group_size, **kw)
        assert torch.equal(adv, torch.zeros_like(adv)), (name, kw, value, float(adv.abs().max()))
    # Group-level estimators: an equal group next to a non-equal one still gets exact zeros.
    if n_groups >= 2:
        rewards = rewards.clone()
        rewards[group_size:2 * group_size] = torch.linspace(mixed, mixed + 1.0, group_size)
        for name, kw in EQUAL_REWARD_ESTIMATORS:
            if kw.get("mean_level") == "batch" or name == "reinforce_pp_baseline":
                continue  # batch statistics mix the groups; whitening then shifts every row
            adv, _ = compute_advantages(name, rewards=rewards, loss_mask=mask, group_size=group_size, **kw)
            assert torch.equal(adv[:group_size], torch.zeros_like(adv[:group_size])), (name, kw, value)


def test_equal_rewards_07_regression():
    rewards = torch.full((8,), 0.7)
    adv, _ = compute_advantages("grpo", rewards=rewards, loss_mask=torch.ones(8, 2), group_size=8)
    assert float(adv.abs().max()) == 0.0


# --- item 3: group size 1 ---------------------------------------------------------------------

import pytest  # noqa: E402

from areal_cli.plan.compose import load_config  # noqa: E402
from areal_cli.plan.validate import validate  # noqa: E402
from areal_cli.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize("overrides", [
    ["algo=grpo"],
    ["algo=drgrpo"],
    ["algo=rloo"],
    ["algo=reinforce_pp", "algo.adv_estimator=reinforce_pp_baseline"],
    ["algo=grpo", "algo.mean_level=batch"],  # std over a group of one is 0: A = (r - mean) / eps
    # dynamic sampling drops every group of one (its rewards are trivially equal)
    ["algo=dapo", "algo.ppo_n_minibatches=1"],
])
def test_group_size_one_is_a_config_error(overrides):
    """With one sample per prompt the group baseline is the sample itself: training would run on
    zero advantages (only KL and entropy gradients). validate-config must refuse it."""
    with pytest.raises(ConfigError) as ei:
        validate(load_config([*overrides, "rollout.group_size=1"]))
    assert ei.value.path == "rollout.group_size"
    assert "group_size" in ei.value.hint or "rollout.group_size" in ei.value.hint


@pytest.mark.parametrize("overrides", [
    ["algo=reinforce_pp"], ["algo=grpo", "algo.mean_level=batch", "algo.std_level=batch"], ["algo=sft"],
])
def test_group_size_one_is_fine_without_a_group_baseline(overrides):
    validate(load_config([*overrides, "rollout.group_size=1"]))


# --- item 5: one KL clamp default -------------------------------------------------------------

from pathlib import Path  # noqa: E402

from areal_cli.algorithms.kl import kl_estimate, kl_reward  # noqa: E402
from areal_cli.algorithms.losses import ActorLossParams, actor_loss  # noqa: E402
from areal_cli.config.algo import AlgoConfig  # noqa: E402

DOCS = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"


def test_kl_clamp_has_one_default_everywhere():
    """AlgoConfig, ActorLossParams and the KL functions agree: the loss built without a config
    clamps exactly like the trainer's (ActorLossParams used to default to 0, AlgoConfig to 10)."""
    default = AlgoConfig().kl_clamp
    assert default == 10.0
    assert ActorLossParams().kl_clamp == default
    logp, ref = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([-30.0, 30.0, -0.5])
    for est in ("k1", "k2", "k3"):
        got = kl_estimate(logp, ref, est)
        assert float(got.abs().max()) <= default, est  # |k1| = 30, k2 = 450, k3 = e^30 unclamped
        assert torch.equal(got, kl_estimate(logp, ref, est, clamp=default))
    # KL in the reward and KL in the loss, both with their defaults.
    assert float(kl_reward(logp, ref, torch.ones(3), 1.0, "k3").abs().max()) <= default
    mb = {"loss_mask": torch.ones(1, 3, dtype=torch.bool), "logprobs": logp[None], "ref_logp": ref[None],
          "advantages": torch.zeros(1, 3)}
    _, stats = actor_loss(logp[None].clone().requires_grad_(True), None, mb,
                          ActorLossParams(kl_coef=1.0, kl_estimator="k3"))
    assert stats["kl"] <= default


def test_docs_state_exactly_what_the_kl_clamp_does():
    text = DOCS.read_text()
    assert "verl clamps at 10" not in text  # verl clamps only k3 (low_var_kl), not k1/k2
    assert "verl clamps only k3" in text and "`kl_clamp=10`" in text
    src = (Path(__file__).resolve().parents[3] / "src" / "areal_cli" / "config" / "algo.py").read_text()
    assert "(as verl does)" not in src


# --- item 6: DAPO overlong penalty per turn ---------------------------------------------------

from areal_cli.algorithms.actor import PPOActor  # noqa: E402
from areal_cli.rollout.workflows.common import Segment, build_row, stack_rows  # noqa: E402


def _dialogue(*turns: int) -> list[Segment]:
    """A multi_turn row: prompt, then each generated turn followed by feedback context tokens."""
    segs = [Segment([1, 2, 3])]
    for i, n in enumerate(turns):
        if i:
            segs.append(Segment([7, 7, 7]))  # feedback + chat template: context, not trained
        segs.append(Segment([5] * n, [-0.1] * n, [0] * n))
    return segs


def test_overlong_penalty_is_per_turn_under_multi_turn():
    """max_new_tokens limits each turn. Two 4-token turns under a limit of 8 with a 4-token buffer
    were never near the limit: no penalty (it used to count all 8 tokens and give -1)."""
    rows = [build_row(_dialogue(4, 4)), build_row(_dialogue(6, 2)), build_row(_dialogue(6)),
            build_row(_dialogue(2, 2, 2, 2))]
    batch = dict(stack_rows(rows, [1.0, 1.0, 1.0, 1.0], [False] * 4, 0, 0).data)
    cfg = AlgoConfig(name="dapo", overlong_buffer_len=4, overlong_penalty_factor=1.0, kl_coef=0.0,
                     adv_estimator="grpo", mean_level="batch", std_level="none")
    actor = PPOActor(cfg, engine=None, group_size=4, max_new_tokens=8)
    out = actor.compute_advantages(batch)
    # free up to 8 - 4 = 4 tokens per turn; the longest turn counts: 4 → 0, 6 → -(6-4)/4 = -0.5
    assert out["shaped_rewards"].tolist() == pytest.approx([1.0, 0.5, 0.5, 1.0])


# --- item 7: Dr.GRPO's constant normaliser ----------------------------------------------------

from areal_cli.algorithms.normalisation import aggregate_loss, count_units  # noqa: E402
from areal_cli.algorithms.registry import LOSS_AGG  # noqa: E402

NORM_MODE = "seq-mean-token-sum-norm"
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3: no trained token


def test_seq_mean_token_sum_norm_divides_by_a_constant():
    """verl's seq-mean-token-sum-norm / the Dr.GRPO authors' constant_normalizer: each sequence's token
    sum divided by a fixed generation budget, averaged over sequences."""
    assert NORM_MODE in LOSS_AGG and LOSS_AGG.spec(NORM_MODE).needs_norm
    # (6 + 4) / 2 sequences / 8
    assert aggregate_loss(AGG_LOSS, AGG_MASK, NORM_MODE, norm=8).item() == pytest.approx(10 / 2 / 8)
    assert count_units(AGG_MASK, NORM_MODE) == 2
    with pytest.raises(ValueError, match="norm"):
        aggregate_loss(AGG_LOSS, AGG_MASK, NORM_MODE)
    full = aggregate_loss(AGG_LOSS, AGG_MASK, NORM_MODE, norm=8).item()
    for cut in (1, 2):  # the engine's weight / global_weight rescaling reproduces the full batch
        parts = [(AGG_LOSS[:cut], AGG_MASK[:cut]), (AGG_LOSS[cut:], AGG_MASK[cut:])]
        total = sum(count_units(m, NORM_MODE) for _, m in parts)
        got = sum(aggregate_loss(x, m, NORM_MODE, norm=8).item() * count_units(m, NORM_MODE) / total
                  for x, m in parts)
        assert got == pytest.approx(full)


def test_drgrpo_preset_uses_the_constant_normaliser_of_the_generation_budget():
    cfg = load_config(["algo=drgrpo"])
    assert cfg.algo.loss_agg == NORM_MODE
    actor = PPOActor(cfg.algo, engine=None, group_size=2, max_new_tokens=64)
    assert actor.loss_agg_norm == 64.0  # handed to ActorLossParams.loss_agg_norm by loss_params()
    with pytest.raises(ConfigError) as ei:
        PPOActor(cfg.algo, engine=None, group_size=2, max_new_tokens=None)
    assert ei.value.path == "algo.loss_agg"
    # The actor objective with the preset is the token-sum objective divided by max_new_tokens.
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, -0.1]], requires_grad=True)
    mb = {"loss_mask": torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool),
          "logprobs": logp.detach().clone(), "advantages": torch.tensor([[0.0, 1.0, 1.0], [0.0, -2.0, 0.0]])}
    base = ActorLossParams(loss_agg="seq-mean-token-sum")
    normed = ActorLossParams(loss_agg=NORM_MODE, loss_agg_norm=64.0)
    assert actor_loss(logp, None, mb, normed)[0].item() == pytest.approx(
        actor_loss(logp, None, mb, base)[0].item() / 64)
