"""RolloutExecutor logic against an in-process fake InferenceEngine (the executor is under test)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from rollout_fakes import FakeEngine, LengthWorkflow, fake_logprob, fake_token

from areal_cli.api.io_struct import WeightUpdateMeta
from areal_cli.errors import ConfigError, DataError
from areal_cli.rollout import (
    RolloutError,
    RolloutExecutor,
    RolloutQueueFull,
    has_reward_variance,
    staleness_stats,
)


def item(i: int, n: int = 4, **kw):
    return {"prompt_ids": [1, 2, 3 + i % 5], "len": n, "id": i, **kw}


@pytest.fixture
def make_executor():
    made: list[RolloutExecutor] = []

    def _make(engine=None, **kw):
        engine = engine or FakeEngine()
        kw.setdefault("batch_size", 2)
        kw.setdefault("max_concurrent", 16)
        kw.setdefault("max_head_offpolicyness", 1)
        ex = RolloutExecutor(engine, kw.pop("workflow", LengthWorkflow()), **kw)
        made.append(ex)
        return ex, engine

    yield _make
    for ex in made:
        ex.destroy()


def generated_versions(batch) -> torch.Tensor:
    return batch.data["versions"][batch.data["loss_mask"]]


def test_submit_wait_concatenates_with_correct_tokens(make_executor):
    ex, eng = make_executor(batch_size=3, max_head_offpolicyness=0)
    lens = [3, 5, 2]
    for i, n in enumerate(lens):
        ex.submit(item(i, n))
    batch = ex.wait(3, timeout=10)
    assert len(batch) == 3
    assert batch.data["input_ids"].shape == (3, 3 + 5)
    for row in range(3):
        i = batch.meta["item"][row]
        prompt = item(i)["prompt_ids"]
        n = lens[i]
        ids = batch.data["input_ids"][row]
        assert ids[:3].tolist() == prompt
        assert ids[3:3 + n].tolist() == [fake_token(prompt, p) for p in range(n)]
        assert batch.data["loss_mask"][row].tolist() == [False] * 3 + [True] * n + [False] * (5 - n)
        assert batch.data["attention_mask"][row].sum() == 3 + n
        want_lp = [0.0] * 3 + [fake_logprob(fake_token(prompt, p), p) for p in range(n)] + [0.0] * (5 - n)
        assert batch.data["logprobs"][row].tolist() == pytest.approx(want_lp)
        assert batch.data["versions"][row].tolist() == [-1] * 3 + [0] * n + [-1] * (5 - n)
    assert sorted(batch.meta["episode_id"]) == [0, 1, 2]
    assert batch.meta["submit_version"] == [0, 0, 0]
    st = ex.get_stats()
    assert st["rollout/accepted"] == 3 and st["rollout/consumed"] == 3 and st["rollout/running"] == 0


def simulate_training(ex: RolloutExecutor, eng: FakeEngine, data, k: int, steps: int, train_s: float = 0.005):
    """The trainer's loop: batch → check → train → pause → push weights → resume."""
    seen = []
    for _ in range(steps):
        batch = ex.prepare_batch(data, timeout=30)
        v = ex.get_version()
        gv = generated_versions(batch)
        assert gv.numel() > 0
        assert int(gv.min()) >= v - k, f"token older than {k} versions behind consumer {v}"
        assert int(gv.max()) <= v
        if k == 0:
            assert torch.all(gv == v)
            assert batch.meta["submit_version"] == [v] * len(batch.meta["submit_version"])
        assert ex.last_batch_stats["staleness/max"] <= k
        seen.append(v - int(gv.min()))
        time.sleep(train_s)
        ex.pause()
        ex.run_coroutine(eng.pause_generation())
        ex.run_coroutine(eng.update_weights_from_disk(WeightUpdateMeta(version=v + 1)))
        ex.run_coroutine(eng.continue_generation())
        ex.set_version(v + 1)
        ex.resume()
    return seen


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_staleness_invariant_with_random_lengths(make_executor, k):
    rng = random.Random(k)
    data = [item(i, rng.choice([1, 2, 3, 20, 40])) for i in range(64)]
    ex, eng = make_executor(batch_size=4, max_concurrent=32, max_head_offpolicyness=k)
    lags = simulate_training(ex, eng, data, k, steps=8)
    assert max(lags) <= k
    assert ex.get_stats()["rollout/max_token_staleness"] <= k
    if k >= 2:
        assert max(lags) >= 1  # the run really was off-policy


def test_straggler_is_held_back_not_consumed_too_late(make_executor):
    """k=1, B=1: a 400-token episode admitted at v0 must be consumed by v1 even though later,
    shorter episodes finish first (completion-order release would hand it out at v3+)."""
    eng = FakeEngine(token_delay=0.001)
    ex, _ = make_executor(engine=eng, batch_size=1, max_concurrent=8, max_head_offpolicyness=1)
    data = iter([item(0, 400)] + [item(i, 2) for i in range(1, 40)])
    consumed = []
    for _ in range(4):
        batch = ex.prepare_batch(data, timeout=30)
        v = ex.get_version()
        consumed.append((batch.meta["item"][0], batch.meta["submit_version"][0], v))
        assert v - int(generated_versions(batch).min()) <= 1
        ex.set_version(v + 1)
        eng.version = v + 1
    by_item = {i: (s, v) for i, s, v in consumed}
    assert 0 in by_item and by_item[0][1] <= 1, consumed
    tokens_of_straggler = [i for i, _, _ in consumed].index(0)
    assert tokens_of_straggler <= 1


def test_k0_admits_exactly_one_batch_per_version(make_executor):
    ex, eng = make_executor(batch_size=3, max_head_offpolicyness=0, queue_size=12)
    for i in range(9):
        ex.submit(item(i, 2))
    time.sleep(0.3)
    assert ex.get_stats()["rollout/submitted"] == 3
    ex.wait(3, timeout=5)
    time.sleep(0.2)
    assert ex.get_stats()["rollout/submitted"] == 3  # version not bumped: nothing new
    ex.set_version(1)
    eng.version = 1
    b = ex.wait(3, timeout=5)
    assert torch.all(generated_versions(b) == 1)
    assert ex.get_stats()["rollout/submitted"] == 6


def test_dynamic_sampling_rejects_uniform_groups_without_deadlock(make_executor):
    ex, eng = make_executor(batch_size=2, max_concurrent=4, max_head_offpolicyness=0,
                            should_accept=has_reward_variance)
    data = []
    for i in range(40):  # 3 of every 4 groups have all-equal rewards
        rewards = [1.0, 0.0] if i % 4 == 3 else [float(i % 2)] * 2
        data.append(item(i, 2, rewards=rewards, gid=i))
    for step in range(3):
        batch = ex.prepare_batch(data, timeout=20)
        assert len(batch) == 4  # 2 groups x 2 samples
        assert all(i % 4 == 3 for i in batch.meta["item"])
        assert torch.all(generated_versions(batch) == step)
        ex.set_version(step + 1)
        eng.version = step + 1
    st = ex.get_stats()
    assert st["rollout/accepted"] == 6 and st["rollout/rejected"] >= 12


def test_workflow_returning_none_is_rejected_and_frees_capacity(make_executor):
    ex, _ = make_executor(batch_size=1, max_concurrent=1, max_head_offpolicyness=0)
    ex.submit(item(0, 2, reject=True))
    ex.submit(item(1, 2))
    b = ex.wait(1, timeout=5)
    assert b.meta["item"] == [1]
    assert ex.get_stats()["rollout/rejected"] == 1


def test_episode_exception_surfaces_in_wait(make_executor):
    ex, _ = make_executor(batch_size=1)
    ex.submit(item(0, 2, fail=True))
    with pytest.raises(RolloutError, match="episode exploded"):
        ex.wait(1, timeout=5)
    assert ex.get_stats()["rollout/failed"] == 1


def test_bounded_input_queue(make_executor):
    eng = FakeEngine(token_delay=0.05)
    ex, _ = make_executor(engine=eng, batch_size=1, max_head_offpolicyness=0, queue_size=2)
    ex.submit(item(0, 1000), block=False)
    deadline = time.monotonic() + 10
    while ex.get_stats()["rollout/submitted"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    ex.submit(item(1, 2), block=False)  # capacity is used up: these two stay queued
    ex.submit(item(2, 2), block=False)
    with pytest.raises(RolloutQueueFull):
        ex.submit(item(9, 2), block=False)
    with pytest.raises(RolloutQueueFull):
        ex.submit(item(9, 2), timeout=0.1)


def test_pause_stops_admission_and_resume_restarts(make_executor):
    ex, _ = make_executor(batch_size=2, max_head_offpolicyness=3)
    ex.pause()
    for i in range(4):
        ex.submit(item(i, 2))
    time.sleep(0.3)
    assert ex.get_stats()["rollout/submitted"] == 0
    with pytest.raises(TimeoutError):
        ex.wait(1, timeout=0.2)
    ex.resume()
    assert len(ex.wait(4, timeout=5)) == 4


def test_trajectory_spans_versions_across_pause(make_executor):
    """Engine paused mid-episode, weights bumped, generation continued: one contiguous sequence."""
    eng = FakeEngine(token_delay=0.01)
    ex, _ = make_executor(engine=eng, batch_size=1, max_head_offpolicyness=1)
    ex.submit(item(0, 30))
    time.sleep(0.1)
    ex.run_coroutine(eng.pause_generation())
    ex.run_coroutine(eng.update_weights_from_disk(WeightUpdateMeta(version=1)))
    ex.run_coroutine(eng.continue_generation())
    ex.set_version(1)
    b = ex.wait(1, timeout=10)
    v = b.data["versions"][0, 3:].tolist()
    assert v[0] == 0 and v[-1] == 1 and v == sorted(v)
    prompt = item(0)["prompt_ids"]
    assert b.data["input_ids"][0, 3:].tolist() == [fake_token(prompt, p) for p in range(30)]


def test_state_dict_restores_consumed_as_accepted(make_executor):
    ex, eng = make_executor(batch_size=2, max_head_offpolicyness=1)
    data = [item(i, 2) for i in range(20)]
    simulate_training(ex, eng, data, k=1, steps=3)
    state = ex.state_dict()
    assert state["consumed"] == 6 and state["staleness"]["accepted"] == 6 and state["version"] == 3
    ex2, eng2 = make_executor(batch_size=2, max_head_offpolicyness=1)
    ex2.load_state_dict(state)
    eng2.version = 3
    assert ex2.get_version() == 3
    assert ex2.staleness.get_capacity() == (1 + 3 + 1) * 2 - 6
    b = ex2.prepare_batch(data, timeout=10)
    assert torch.all(generated_versions(b) == 3)
    assert ex2.state_dict()["consumed"] == 8


def test_prepare_batch_cycles_reiterables_and_reports_dry_iterators(make_executor):
    ex, _ = make_executor(batch_size=2, max_head_offpolicyness=4)
    data = [[item(0, 1), item(1, 1)], [item(2, 1)]]  # batches of items, cycled
    ids = []
    for _ in range(3):
        ids += ex.prepare_batch(data, timeout=10).meta["item"]
    assert len(ids) == 6 and set(ids) == {0, 1, 2}
    ex2, _ = make_executor(batch_size=2, max_head_offpolicyness=4)
    with pytest.raises(DataError, match="ran out"):
        ex2.prepare_batch(iter([item(0, 1)]), timeout=10)


def test_wait_timeout_and_bad_count(make_executor):
    ex, _ = make_executor()
    with pytest.raises(TimeoutError):
        ex.wait(1, timeout=0.1)
    with pytest.raises(ValueError):
        ex.wait(0)
    with pytest.raises(ValueError, match="never complete"):
        ex.wait(5)  # k=1, batch 2: at most 4 per version


def test_destroy_cancels_running_episodes_promptly(make_executor):
    eng = FakeEngine(token_delay=0.05)
    ex, _ = make_executor(engine=eng, batch_size=4)
    for i in range(4):
        ex.submit(item(i, 1000))
    time.sleep(0.1)
    t0 = time.monotonic()
    ex.destroy()
    assert time.monotonic() - t0 < 5
    assert not ex._thread.is_alive()
    assert ex.staleness.stats.running == 0
    with pytest.raises(RuntimeError):
        ex.submit(item(9))
    ex.destroy()  # idempotent


def test_max_concurrent_bounds_inflight_requests(make_executor):
    eng = FakeEngine(token_delay=0.002)
    ex, _ = make_executor(engine=eng, batch_size=8, max_concurrent=3, max_head_offpolicyness=2)
    for i in range(12):
        ex.submit(item(i, 10))
    ex.wait(8, timeout=10)
    assert eng.max_inflight == 3


def test_wait_from_another_thread_sees_results(make_executor):
    ex, _ = make_executor(batch_size=2)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", ex.wait(2, timeout=10)))
    t.start()
    time.sleep(0.05)
    ex.submit(item(0, 2))
    ex.submit(item(1, 2))
    t.join(10)
    assert len(out["b"]) == 2


def test_staleness_stats_function():
    from areal_cli.api.workflow_api import Trajectory

    versions = torch.tensor([[-1, 2, 3, 3], [-1, -1, 1, -1]])
    mask = versions >= 0
    t = Trajectory({"input_ids": torch.zeros(2, 4, dtype=torch.long), "versions": versions,
                    "loss_mask": mask})
    s = staleness_stats(t, 3)
    assert s["staleness/max"] == 2 and s["staleness/mean"] == pytest.approx((1 + 0 + 0 + 2) / 4)
    assert s["staleness/min_version"] == 1 and s["staleness/n_tokens"] == 4


def test_bad_queue_size_is_config_error():
    with pytest.raises(ConfigError) as ei:
        RolloutExecutor(FakeEngine(), LengthWorkflow(), batch_size=2, max_concurrent=2,
                        max_head_offpolicyness=0, queue_size=0)
    assert ei.value.path == "rollout.queue_size"


def test_executor_started_at_a_later_version_is_not_ahead(make_executor):
    """A new executor on servers already at version 5 admits one batch for k=0, not six."""
    eng = FakeEngine()
    eng.version = 5
    ex, _ = make_executor(engine=eng, batch_size=2, max_head_offpolicyness=0, queue_size=8)
    for i in range(6):
        ex.submit(item(i, 2))
    b = ex.wait(2, timeout=5)
    time.sleep(0.2)
    assert ex.get_stats()["rollout/submitted"] == 2
    assert torch.all(generated_versions(b) == 5)


def test_set_version_before_first_episode_rebases(make_executor):
    ex, eng = make_executor(batch_size=2, max_head_offpolicyness=0, queue_size=8)
    ex.set_version(7)
    eng.version = 7
    assert ex.staleness.start_version == 7 and ex.staleness.get_capacity() == 2
    b = ex.prepare_batch([item(i, 2) for i in range(4)], timeout=5)
    assert torch.all(generated_versions(b) == 7)
    ex.set_version(8)
    assert ex.staleness.start_version == 7  # counting has started: a real version step


def test_should_accept_that_raises_is_an_episode_failure(make_executor):
    def boom(traj):
        raise KeyError("rewards")

    ex, _ = make_executor(batch_size=1, should_accept=boom)
    ex.submit(item(0, 2))
    with pytest.raises(RolloutError, match="KeyError"):
        ex.wait(1, timeout=5)


def test_has_reward_variance_per_group():
    from areal_cli.api.workflow_api import Trajectory

    def traj(rewards, gids=None):
        d = {"input_ids": torch.zeros(len(rewards), 2, dtype=torch.long), "rewards": torch.tensor(rewards)}
        if gids is not None:
            d["group_id"] = torch.tensor(gids)
        return Trajectory(d)

    assert has_reward_variance(traj([0.0, 1.0]))
    assert not has_reward_variance(traj([1.0, 1.0]))
    assert not has_reward_variance(traj([1.0]))
    assert has_reward_variance(traj([0.0, 1.0, 1.0, 0.0], [7, 7, 8, 8]))
    assert not has_reward_variance(traj([0.0, 1.0, 1.0, 1.0], [7, 7, 8, 8]))  # group 8 is flat


def test_dynamic_sampling_stops_in_one_line_when_every_group_is_flat(make_executor):
    """A filter that turns down everything (data the model always or never solves) would wait for ever:
    after ``reject_patience`` rejections in a row the trainer gets the user's one-line error."""
    ex, _ = make_executor(batch_size=2, max_concurrent=4, max_head_offpolicyness=0,
                          should_accept=has_reward_variance, reject_patience=6)
    flat = [item(i, 2, rewards=[1.0, 1.0], gid=i) for i in range(40)]
    with pytest.raises(ConfigError, match="algo.dynamic_sampling: 6 groups in a row got one reward"):
        ex.prepare_batch(flat, timeout=30)
    assert ex.get_stats()["rollout/rejected"] >= 6


def test_dynamic_sampling_patience_counts_rejections_in_a_row_only(make_executor):
    ex, _ = make_executor(batch_size=2, max_concurrent=1, max_head_offpolicyness=0,
                          should_accept=has_reward_variance, reject_patience=3)
    # two flat groups, then one that trains, repeated: never three flat ones in a row
    data = [item(i, 2, rewards=[1.0, 0.0] if i % 3 == 2 else [0.0, 0.0], gid=i) for i in range(30)]
    batch = ex.prepare_batch(data, timeout=30)
    assert len(batch) == 4 and all(i % 3 == 2 for i in batch.meta["item"])
