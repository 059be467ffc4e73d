"""The rollout side in a worker process (``rollout.process=true``) against the same side as a thread.

- Against a real hf server in sync mode, the worker and the in-process service hand out the same
  batches (same prompt positions, tokens, versions and rewards; logprobs to 1e-4, as the server's
  batching follows arrival times) and the same saved state.
- An episode's error reaches the trainer as the executor's RolloutError, with the cause in it.
- A worker killed with SIGKILL is named on the trainer's next call, not waited on.
- A trainer killed with SIGKILL takes its worker with it (no orphan).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest
import torch
from support_paths import SUPPORT

from areal_cli.rollout.executor import RolloutError
from areal_cli.rollout.worker import RolloutProcess, RolloutService, RolloutWorkerDied

pytestmark = pytest.mark.timeout(600)

HERE = str(SUPPORT)


def _cfg(root: str, *overrides: str):
    from areal_cli.plan.compose import load_config

    return load_config([f"cluster.fileroot={root}", "dataset.train_size=64", "dataset.test_size=8", "dataset.max_prompt_len=512",
                        "algo.batch_size=4", "rollout.group_size=2", "rollout.gconfig.max_new_tokens=8",
                        *overrides])


def _items(cfg, model_dir: str) -> list[dict]:
    from areal_cli.rollout import build as rollout_build
    from areal_cli.trainer import build

    train, _ = build.build_datasets(cfg, rollout_build.build_tokenizer(model_dir))
    return train


def _two_batches(side) -> tuple[list[dict], dict]:
    side.set_version(0)
    side.resume()
    out = []
    for v in (1, 2):
        got = None
        while got is None:
            got = side.next_batch(2.0)
        out.append(got)
        side.pause()
        side.set_version(v)
        if v < 2:  # nothing admitted after the last batch: the saved counts do not race admission
            side.resume()
    return out, side.state_dict()


def test_worker_process_gives_the_same_batches_as_the_thread(tiny_model_dir, tmp_path, tmp_path_factory):
    from hf_server_helpers import start_hf_server

    # Each form gets a fresh server and runs one episode at a time, so both send the same requests
    # in the same order. The server's logprobs still differ in the last bits from run to run (its
    # batching follows arrival times), hence the tolerance on them alone.
    cfg = _cfg(str(tmp_path), "rollout.max_head_offpolicyness=0", "rollout.max_concurrent_rollouts=1")
    items = _items(cfg, tiny_model_dir)
    results = {}
    for name, cls in (("thread", RolloutService), ("process", RolloutProcess)):
        server = start_hf_server(tiny_model_dir, tmp_path_factory)
        try:
            side = cls(cfg, [server.address], "hf", tiny_model_dir, items)
            try:
                results[name] = _two_batches(side)
            finally:
                side.close()
        finally:
            server.stop()
    (t_batches, t_state), (p_batches, p_state) = results["thread"], results["process"]
    assert t_state == p_state
    assert t_state["stream"]["position"] == 8  # two batches of 4 prompts, consumed in order
    for t, p in zip(t_batches, p_batches):
        assert t["stats"]["data/positions"] == p["stats"]["data/positions"]
        assert set(t["data"]) == set(p["data"])
        for k, tv in t["data"].items():
            pv = p["data"][k]
            assert isinstance(pv, torch.Tensor) and pv.dtype == tv.dtype, k
            if k == "group_id":  # a per-process counter: compare which rows share a group
                tv, pv = tv - tv.min(), pv - pv.min()
            if tv.is_floating_point() and k == "logprobs":
                torch.testing.assert_close(pv, tv, rtol=0, atol=1e-4, msg=k)
            else:
                assert torch.equal(tv, pv), (k, tv, pv)
    assert [b["stats"]["data/positions"] for b in p_batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert int(p_batches[0]["data"]["loss_mask"].sum()) > 0


def test_episode_error_reaches_the_trainer(tiny_model_dir, tmp_path):
    cfg = _cfg(str(tmp_path), "workflow.name=rollout_worker_helpers.ExplodingWorkflow")
    side = RolloutProcess(cfg, ["127.0.0.1:9"], "hf", tiny_model_dir, _items(cfg, tiny_model_dir))
    try:
        side.set_version(0)
        side.resume()
        with pytest.raises(RolloutError, match="episode exploded at position"):
            side.next_batch(30.0)
        side.state_dict()  # the worker still answers after an episode error
    finally:
        side.close()
    assert side._proc.exitcode == 0


def test_killed_worker_is_named(tiny_model_dir, tmp_path):
    cfg = _cfg(str(tmp_path))
    side = RolloutProcess(cfg, ["127.0.0.1:9"], "hf", tiny_model_dir, _items(cfg, tiny_model_dir))
    try:
        os.kill(side.pid, signal.SIGKILL)
        side._proc.join(10)
        with pytest.raises(RolloutWorkerDied, match="exited"):
            side.state_dict()
    finally:
        side.close()


WORKER_SCRIPT = """
import sys, time
sys.path[:0] = [{here!r}, {support!r}]
from test_rollout_worker import _cfg, _items
from areal_cli.rollout.worker import RolloutProcess
cfg = _cfg({root!r})
side = RolloutProcess(cfg, ["127.0.0.1:9"], "hf", {model!r}, _items(cfg, {model!r}))
print(side.pid, flush=True)
time.sleep(600)
"""


def test_worker_dies_with_a_killed_trainer(tiny_model_dir, tmp_path):
    script = WORKER_SCRIPT.format(here=str(Path(__file__).resolve().parent), support=HERE, root=str(tmp_path),
                                  model=tiny_model_dir)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(trainer.stdout.readline())
        os.kill(worker_pid, 0)  # alive while its trainer is
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(worker_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(worker_pid, signal.SIGKILL)
            pytest.fail("the rollout worker outlived its SIGKILLed trainer")
    finally:
        if trainer.poll() is None:
            trainer.kill()
