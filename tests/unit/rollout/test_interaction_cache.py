"""Interaction cache: parent links, rewards, the discount, export rows and masks."""

import pytest
import torch

from areal_cli.rollout.interaction_cache import Interaction, InteractionCache, rows_to_tensors


def _it(cid, msgs, inp, out, reply, parent=None, tparent=None, stop="stop"):
    return Interaction(id=cid, messages=msgs, tools=None, input_ids=inp, output_ids=out,
                       logprobs=[-0.5] * len(out), versions=[3] * len(out), stop_reason=stop,
                       output_message={"role": "assistant", "content": reply}, parent_id=parent,
                       token_parent_id=tparent)


def _chain(cache, n=3):
    msgs = [{"role": "user", "content": "q"}]
    ids, prev = [1, 2], None
    for k in range(n):
        out = [10 + k, 11 + k]
        it = _it(f"c{k}", list(msgs), list(ids), out, f"a{k}", prev, prev)
        assert (cache.find_parent(msgs).id if cache.find_parent(msgs) else None) == prev
        cache.add(it)
        msgs = msgs + [{"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": f"more{k}"}]
        ids = ids + out + [7, 8]  # the template's tokens between the turns
        prev = it.id
    return cache


def test_discount_chain_and_only_once():
    c = _chain(InteractionCache())
    c.set_last_reward(2)
    assert c.apply_discount(0.9) == pytest.approx({"c0": 1.62, "c1": 1.8, "c2": 2.0})
    with pytest.raises(RuntimeError, match="already applied"):
        c.apply_discount(0.9)


def test_discount_explicit_rewards_and_branches():
    c = _chain(InteractionCache())
    c.set_reward("c1", 1.5)
    c.set_reward("c2", 2.5)
    assert c.apply_discount(0.85)["c1"] == pytest.approx(1.5 + 0.85 * 2.5)
    # two branches continuing c0: the parent takes their mean, and they never see each other's reward
    b = InteractionCache()
    q = [{"role": "user", "content": "q"}]
    b.add(_it("r", q, [1], [2], "a"))
    follow = q + [{"role": "assistant", "content": "a"}]
    b.add(_it("x", follow + [{"role": "user", "content": "x"}], [1, 2, 5], [6], "ax", "r", "r"))
    b.add(_it("y", follow + [{"role": "user", "content": "y"}], [1, 2, 9], [4], "ay", "r", "r"))
    b.set_reward("x", 1.0)
    b.set_reward("y", 0.0)
    out = b.apply_discount(1.0)
    assert out == {"r": 0.5, "x": 1.0, "y": 0.0}


def test_reward_errors():
    c = InteractionCache()
    with pytest.raises(RuntimeError, match="no calls"):
        c.set_last_reward(1.0)
    _chain(c, 1)
    with pytest.raises(KeyError):
        c.set_reward("nope", 1.0)
    for bad in (float("nan"), True, "1"):
        with pytest.raises(ValueError):
            c.set_last_reward(bad)


def test_parent_needs_exact_prefix():
    c = _chain(InteractionCache(), 1)
    edited = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a0 (edited)"},
              {"role": "user", "content": "x"}]
    assert c.find_parent(edited) is None
    none_content = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a0"}]
    assert c.find_parent(none_content + [{"role": "user", "content": "x"}]).id == "c0"


def test_export_per_call_and_per_leaf_masks():
    c = _chain(InteractionCache())
    c.set_reward("c0", 0.5)
    c.set_last_reward(2.0)
    per_call = c.export("per_call")
    assert len(per_call) == 3 and [r["reward"] for r in per_call] == [0.5, 0.0, 2.0]
    leaf = c.export("per_leaf")
    assert len(leaf) == 1 and leaf[0]["ids"] == ["c0", "c1", "c2"]
    traj = rows_to_tensors(leaf, pad_id=0, group_id=4)
    d = traj.data
    assert d["input_ids"][0].tolist() == [1, 2, 10, 11, 7, 8, 11, 12, 7, 8, 12, 13]
    assert d["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert d["versions"][0].tolist() == [-1, -1, 3, 3, -1, -1, 3, 3, -1, -1, 3, 3]
    assert d["rewards"].tolist() == [2.0]
    # c0's reward on its last generated token
    assert d["token_rewards"][0].tolist() == [0, 0, 0, 0.5, 0, 0, 0, 0, 0, 0, 0, 0]
    assert d["group_id"].tolist() == [4]
    rows = rows_to_tensors(per_call, pad_id=0, group_id=4).data
    assert rows["loss_mask"].sum(1).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="export style"):
        c.export("concat")


def test_per_turn_rewards_reach_the_advantages():
    from areal_cli.algorithms.advantages import compute_advantages

    c = _chain(InteractionCache(), 2)
    c.set_reward("c0", 1.0)
    c.set_last_reward(0.0)
    d = rows_to_tensors(c.export("per_leaf"), 0, 0).data
    adv, _ = compute_advantages("reinforce_pp", rewards=d["rewards"], loss_mask=d["loss_mask"].float(),
                                token_rewards=d["token_rewards"], gamma=1.0)
    ret = _[0]
    # the first turn earned 1.0, the second nothing: returns are 1 on the first turn's tokens, 0 after
    assert ret[d["loss_mask"][0]].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.isfinite(adv).all()


def test_groups_by_id_when_episodes_have_different_row_counts():
    from areal_cli.algorithms.advantages import compute_advantages, group_index

    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0, 3.0])
    mask = torch.ones(5, 3)
    gid = torch.tensor([7, 7, 7, 9, 9])  # an episode of 3 calls, then one of 2
    assert group_index(torch.tensor([4, 4, 8, 8]), 4, 2) is None  # consecutive blocks: positional
    for est in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline"):
        adv, _ = compute_advantages(est, rewards=rewards, loss_mask=mask, group_size=2, group_ids=gid)
        parts = [compute_advantages(est, rewards=rewards[sl], loss_mask=mask[sl], group_size=n)[0]
                 for sl, n in ((slice(0, 3), 3), (slice(3, 5), 2))]
        if est == "reinforce_pp_baseline":  # whitened over the whole batch: compare before whitening
            continue
        assert torch.allclose(adv, torch.cat(parts)), est
    with pytest.raises(ValueError, match="whole number of groups"):  # without ids: refused as before
        compute_advantages("grpo", rewards=rewards, loss_mask=mask, group_size=2)


def test_episode_slices_and_canonical_order_with_variable_rows():
    from areal_cli.rollout.worker import canonical_order, episode_slices

    batch = {"input_ids": torch.arange(6)[:, None], "group_id": torch.tensor([5, 5, 5, 2, 8, 8])}
    assert episode_slices(batch, 3) == [(0, 3), (3, 4), (4, 6)]
    out = canonical_order(batch, [2, 0, 1])  # episodes back in prompt order
    assert out["input_ids"][:, 0].tolist() == [3, 4, 5, 0, 1, 2]
    assert episode_slices({"input_ids": torch.zeros(4, 1)}, 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="cannot split"):
        episode_slices({"input_ids": torch.zeros(5, 1)}, 2)
