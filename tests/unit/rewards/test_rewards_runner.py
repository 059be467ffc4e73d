"""AsyncRewardRunner: a reward that raises, one that hangs, one that returns garbage and one that kills
its worker all yield 0.0 and are counted; the batch completes and the pool keeps working."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from areal_cli.rewards import AsyncRewardRunner
from areal_cli.rewards.runner import as_reward


def misbehaving_reward(prompt: str, completion: str, answer: str, **kw) -> float:
    if completion == "raise":
        raise RuntimeError("reward bug")
    if completion == "hang":
        time.sleep(600)
    if completion == "garbage":
        return "banana"  # type: ignore[return-value]
    if completion == "nan":
        return float("nan")
    if completion == "die":
        os._exit(7)
    return float(completion == answer)


def test_pool_survives_raise_hang_garbage_and_dead_worker():
    items = [("q", "4", "4"), ("q", "raise", "4"), ("q", "hang", "4"), ("q", "garbage", "4"),
             ("q", "5", "4"), ("q", "die", "4"), ("q", "nan", "4"), ("q", "4", "4")]

    async def main(runner):
        t0 = time.monotonic()
        out = await runner.score_many(items)
        return out, time.monotonic() - t0

    with AsyncRewardRunner(misbehaving_reward, max_workers=2, timeout_s=2.0) as runner:
        rewards, elapsed = asyncio.run(main(runner))
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert runner.stats.as_dict() == {"ok": 3, "error": 2, "timeout": 1, "garbage": 2}
        assert elapsed < 120  # the hang was cut off, not waited out (600 s)
        # the pool was repaired: both slots serve again, from a new event loop too
        again = asyncio.run(runner.score_many([("q", "1", "1"), ("q", "2", "1")]))
        assert again == [1.0, 0.0] and runner.stats.ok == 5
        assert any("reward bug" in e for e in runner.recent_errors)


def test_runner_by_name_from_a_background_loop_thread():
    # The rollout executor runs its event loop in a thread of the trainer process.
    result: dict = {}

    def loop_thread(runner):
        result["r"] = asyncio.run(runner.score_many([("q", "so #### 42", "#### 42"), ("q", "41", "42")]))

    with AsyncRewardRunner("numeric", max_workers=1, timeout_s=30.0) as runner:
        th = threading.Thread(target=loop_thread, args=(runner,))
        th.start()
        th.join(timeout=120)
        assert result["r"] == [1.0, 0.0]


def test_as_reward_and_arguments():
    assert as_reward(True) == 1.0 and as_reward(2) == 2.0 and as_reward(0.5) == 0.5
    for bad in ("1.0", None, [1.0], float("inf"), object()):
        assert as_reward(bad) is None
    with pytest.raises(ValueError, match="spawn"):
        AsyncRewardRunner(misbehaving_reward, start_method="fork")
