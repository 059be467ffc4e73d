"""A real `areal train` whose only inference server is SIGKILLed keeps its guarantees after the restart:

- killed *during an evaluation*, the evaluation waits for the restarted server, loads the trainer's
  current weights into it and finishes; the run goes on to the end (issue 22, item 11);
- killed between steps, the restarted server rejoins the distributed weight-update group at the next
  push: the pushes after the restart go over the broadcast group again, not through disk (item 12);
- under ``algo=sft``, killed during the disk push or the evaluation after step 2, the evaluation waits,
  loads the pushed weights into the restarted server and finishes (item 11).

Synchronous mode (k=0), so staleness 0 at every step shows that the server held every pushed version.
Each run takes about 20-30 s (server and trainer start-up plus one server restart).
"""

from __future__ import annotations


import pytest
from train_runs import _hold_then_kill, _overrides, _records, _start, _wait_for

# fault injection, end to end: CI's e2e phase (pytest -m e2e tests/integration)
pytestmark = [pytest.mark.timeout(400), pytest.mark.e2e]


def _finish(proc) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "restarting" in out, out[-4000:]
    return out


def test_server_killed_during_evaluation_is_restarted_and_the_evaluation_finishes(tmp_path, tiny_model_dir):
    steps, batch, n_eval = 3, 2, 384
    run_dir = tmp_path / "runs" / "itest" / "t0"
    # The evaluation after step 2 sends up to 64 requests at once, the rollout at most batch × group = 4:
    # 16 requests held by the paused server are the evaluation's.
    proc = _start(_overrides(tmp_path, tiny_model_dir, **{
        "trainer.total_steps": steps, "algo.batch_size": batch, "rollout.max_head_offpolicyness": 0,
        "trainer.recover_every": 0, "trainer.save_every": 0, "trainer.eval_every": 2,
        "dataset.test_size": n_eval, "rollout.eval_gconfig.max_new_tokens": 128,
        "rollout.eval_gconfig.min_new_tokens": 128, "rollout.gconfig.max_new_tokens": 8}))
    _wait_for(lambda: any(r["kind"] == "train" and r["step"] == 2 for r in _records(run_dir)), proc, 300,
              "step 2")
    _hold_then_kill(run_dir, proc, 16)
    _finish(proc)
    log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert "evaluation at step 2 lost a server" in log, log[-4000:]
    assert "loaded version 2" in log, log[-4000:]  # the restarted server evaluates the step-2 weights
    recs = _records(run_dir)
    evals = {r["step"]: r for r in recs if r["kind"] == "eval"}
    assert sorted(evals) == [0, 2, 3]
    for r in evals.values():
        assert r["eval/n_items"] == n_eval and 0.0 <= r["eval/pass@1"] <= 1.0
    assert evals[2]["eval/server_restarts"] >= 1
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["staleness/max"] == 0 for r in train)
    assert (run_dir / "logs" / "server0.log").read_text().count("===== start server0") == 2


def test_restarted_server_rejoins_the_weight_update_group(tmp_path, tiny_model_dir):
    steps, batch = 10, 2
    run_dir = tmp_path / "runs" / "itest" / "t0"
    # The paused server holds step 2's rollout, so the kill lands in the middle of the run. 512 forced
    # tokens keep each rollout long enough to be caught paused, however fast the machine.
    proc = _start(_overrides(tmp_path, tiny_model_dir, **{
        "trainer.total_steps": steps, "algo.batch_size": batch, "rollout.max_head_offpolicyness": 0,
        "trainer.recover_every": 0, "trainer.save_every": 0, "trainer.eval_every": 0,
        "rollout.weight_update": "distributed", "rollout.gconfig.max_new_tokens": 512,
        "rollout.gconfig.min_new_tokens": 512}))
    _wait_for(lambda: any(r["kind"] == "train" for r in _records(run_dir)), proc, 300, "the first step")
    _hold_then_kill(run_dir, proc, 1)
    _finish(proc)
    train = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["rollout/server_restarts"] >= 1
    # Disk pushes leave <run_dir>/weight_sync/v<version>; before the fix every push after the restart
    # went through disk, the last one included.
    assert not (run_dir / "weight_sync" / f"v{steps}").exists(), "the last push went through disk"
    first = min(r["step"] for r in train if r["rollout/server_restarts"] >= 1)
    after = [r for r in train if r["step"] > first]
    assert len(after) >= 2, [r["step"] for r in train]
    assert [r["weight_sync/disk"] for r in after] == [0.0] * len(after), "pushes after the restart used disk"
    assert all(r["staleness/max"] == 0 for r in train)  # every pushed version reached the server
    assert (run_dir / "logs" / "server0.log").read_text().count("===== start server0") == 2


def test_sft_evaluation_survives_a_killed_server(tmp_path, tiny_model_dir):
    """``algo=sft`` evaluates through the servers after a disk push: a server killed right after step 2
    (during that push or the evaluation) is waited for, loaded from the pushed dir, and the run ends."""
    steps, n_eval = 4, 384
    run_dir = tmp_path / "runs" / "itest" / "t0"
    proc = _start(_overrides(tmp_path, tiny_model_dir, **{
        "algo": "sft", "trainer.total_steps": steps, "trainer.eval_every": 2, "trainer.recover_every": 0,
        "trainer.save_every": 0, "dataset.test_size": n_eval, "rollout.eval_gconfig.max_new_tokens": 128,
        "rollout.eval_gconfig.min_new_tokens": 128}))
    _wait_for(lambda: any(r["kind"] == "sft" and r["step"] == 2 for r in _records(run_dir)), proc, 300,
              "step 2")
    _hold_then_kill(run_dir, proc, 16)  # the evaluation after step 2 (SFT sends nothing else)
    _finish(proc)
    log = (run_dir / "logs" / "trainer_rank0.log").read_text()
    assert "evaluation at step 2 lost a server" in log, log[-4000:]
    evals = {r["step"]: r for r in _records(run_dir) if r["kind"] == "eval"}
    assert sorted(evals) == [0, 2, 4]
    assert all(r["eval/n_items"] == n_eval for r in evals.values())
    assert evals[2]["eval/server_restarts"] >= 1
