"""Unit tests for the train job's own parts: process groups, prompt stream, metrics, report."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from areal_cli.job.address_book import publish_server, read_servers, retract_server
from areal_cli.job.layout import JobLayout, ServerSpec, TrainerSpec
from areal_cli.rollout.data_stream import PromptStream
from areal_cli.utils.procs import ManagedProcess, describe_exit, tail_file

SPAWNER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("CHILDPID", child.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"


def test_group_kill_reaches_grandchildren(tmp_path):
    proc = ManagedProcess("spawner", [sys.executable, "-c", SPAWNER], str(tmp_path / "spawner.log")).start()
    deadline = time.time() + 20
    while "CHILDPID " not in tail_file(proc.log_path) and time.time() < deadline:
        time.sleep(0.05)
    child_pid = int(tail_file(proc.log_path).split("CHILDPID ")[-1].split()[0])
    assert _alive(child_pid)
    proc.stop(timeout=5)
    assert not proc.alive()
    assert not _alive(child_pid), "the grandchild survived the group kill"
    assert describe_exit(proc.poll()) == "killed by SIGTERM"


def test_tail_file_and_missing(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("".join(f"line{i}\n" for i in range(100)))
    assert tail_file(p, 3) == "line97\nline98\nline99"
    assert tail_file(tmp_path / "nope.log") == ""


def test_prompt_stream_resume_sync_is_exact():
    items = [{"q": i} for i in range(7)]
    a = PromptStream(items, seed=3)
    first = a.take(10)
    a.mark_consumed([x.pos for x in first])
    state = json.loads(json.dumps(a.state_dict()))
    rest_a = [x["q"] for x in a.take(9)]
    b = PromptStream(items, seed=3)
    b.load_state_dict(state)
    assert [x["q"] for x in b.take(9)] == rest_a
    # each epoch is a permutation of the items
    c = PromptStream(items, seed=3)
    assert sorted(x["q"] for x in c.take(7)) == list(range(7))


def test_prompt_stream_async_no_loss_no_duplicates():
    items = [{"q": i} for i in range(50)]
    s = PromptStream(items, seed=0, shuffle=False)
    drawn = s.take(12)  # 12 in flight, consumed out of order
    consumed = [drawn[i].pos for i in (0, 1, 2, 5, 7)]
    s.mark_consumed(consumed)
    r = PromptStream(items, seed=0, shuffle=False)
    r.load_state_dict(s.state_dict())
    again = [x.pos for x in r.take(20)]
    assert not set(again) & set(consumed), "a consumed prompt came back"
    lost = {d.pos for d in drawn} - set(consumed)
    assert lost <= set(again), "an unconsumed prompt was lost"


def test_address_book_roundtrip(tmp_path):
    publish_server(tmp_path, 1, "127.0.0.1:2", epoch=0, pid=None, backend="hf")
    publish_server(tmp_path, 0, "127.0.0.1:1", epoch=3, pid=5, backend="hf")
    recs = read_servers(tmp_path)
    assert [r["address"] for r in recs] == ["127.0.0.1:1", "127.0.0.1:2"] and recs[0]["epoch"] == 3
    retract_server(tmp_path, 0)
    assert [r["index"] for r in read_servers(tmp_path)] == [1]


def test_layout_json_roundtrip(tmp_path):
    lay = JobLayout(n_nodes=2, device="cuda", servers=[ServerSpec(0, "sglang", 2, 1, 0, [0, 1])],
                    trainer=TrainerSpec("fsdp", dp=4, nnodes=1, nproc_per_node=4, first_node=1))
    lay.save(tmp_path / "l.json")
    assert JobLayout.load(tmp_path / "l.json") == lay
    assert lay.trainer.node_ranks() == [1] and lay.servers_on(0)[0].name == "server0"


def test_layout_from_plan_default_and_dp2():
    from areal_cli.plan.compose import load_config
    from areal_cli.trainer.build import layout_from_plan

    lay = layout_from_plan(load_config([]), None)
    assert [(s.backend, s.devices) for s in lay.servers] == [("hf", [0])]
    assert (lay.trainer.world_size, lay.trainer.nproc_per_node) == (1, 1)
    lay = layout_from_plan(load_config(["allocation_mode=hf:d2+fsdp:d2", "cluster.n_gpus_per_node=4"]), None)
    assert [s.devices for s in lay.servers] == [[0], [1]]
    assert (lay.trainer.dp, lay.trainer.nproc_per_node) == (2, 2)


def test_metrics_truncate_and_report(tmp_path):
    from types import SimpleNamespace

    from areal_cli.cli.report import MetricsTail, plot_learning_curve, summarize
    from areal_cli.trainer.stats import StatsLogger, read_metrics

    cfg = SimpleNamespace(tensorboard=True, wandb=False)
    log = StatsLogger(str(tmp_path), cfg)
    tail = MetricsTail(tmp_path / "metrics.jsonl")
    log.log("eval", 0, {"eval/pass@1": 0.1})
    for s in range(1, 6):
        log.log("train", s, {"reward/mean": s / 10})
    assert len(tail.read_new()) == 6 and tail.read_new() == []
    log.truncate_after(3)
    assert [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "train"] == [1, 2, 3]
    log.log("eval", 3, {"eval/pass@1": 0.6})
    log.close()
    assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
    summ = summarize(tmp_path)
    assert summ["accuracy_before"] == 0.1 and summ["accuracy_after"] == 0.6 and summ["steps"] == 3
    png = plot_learning_curve(tmp_path)
    assert png and os.path.getsize(png) > 1000


def test_summary_separates_the_warm_start_and_smooths_the_reward(tmp_path):
    from types import SimpleNamespace

    from areal_cli.cli.report import summarize, trailing_mean
    from areal_cli.trainer.stats import StatsLogger

    log = StatsLogger(str(tmp_path), SimpleNamespace(tensorboard=False, wandb=False))
    log.log("eval", 0, {"eval/pass@1": 0.0, "phase": "base"})
    log.log("eval", 0, {"eval/pass@1": 0.5, "phase": "sft"})
    rewards = [0.3, 0.7] * 10 + [0.6, 1.0] * 10  # noisy, +0.3 on average in the second half
    for s, r in enumerate(rewards, start=1):
        log.log("train", s, {"reward/mean": r})
    log.log("eval", 40, {"eval/pass@1": 0.8, "phase": "rl"})
    log.close()
    summ = summarize(tmp_path)
    assert summ["accuracy_warm_start"] == 0.5 and summ["rl_gain"] == pytest.approx(0.3)
    assert summ["reward_smoothed_first"] == pytest.approx(0.5) and summ["reward_smoothed_last"] == pytest.approx(0.8)
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_config_roundtrip(tmp_path):
    from areal_cli.plan.compose import load_config
    from areal_cli.errors import ConfigError
    from areal_cli.config.io import load_config_file, save_config

    cfg = load_config(["trainer.total_steps=3", "rollout.group_size=2"])
    back = load_config_file(save_config(cfg, tmp_path / "c.yaml"))
    assert back == cfg
    with pytest.raises(ConfigError):
        load_config_file(tmp_path / "missing.yaml")


def test_seeded_sampling_independent_of_batching():
    """The hf server's per-request seed (used for exact resume): a row's token depends on its seed
    and position only, not on which other rows share the batch or their order."""
    import torch

    from areal_cli.inference.server.sampling import SamplingParams, sample_next

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeded = [SamplingParams(temperature=1.0, sampling_seed=s) for s in (11, 12, 13)]
    g = torch.Generator().manual_seed(0)
    full, _ = sample_next(logits, seeded, [0, 0, 0], set(), g, positions=[5, 7, 9])
    rev, _ = sample_next(logits.flip(0), seeded[::-1], [0, 0, 0], set(), torch.Generator().manual_seed(99),
                         positions=[9, 7, 5])
    assert full.tolist() == rev.flip(0).tolist()
    alone, _ = sample_next(logits[1:2], seeded[1:2], [0], set(), torch.Generator().manual_seed(5), positions=[7])
    assert alone.item() == full[1].item()
    draws = {sample_next(logits[:1], [SamplingParams(sampling_seed=s)], [0], set(), g, positions=[0])[0].item()
             for s in range(40)}
    assert len(draws) > 3, "different seeds must give different samples"


def test_seeded_engine_assigns_per_request_seeds():
    import asyncio

    from areal_cli.api.io_struct import GenerationConfig, ModelRequest
    from areal_cli.rollout.episodes import SeededEngine as _SeededEngine

    seen = []

    class Inner:
        addresses = ["x"]

        async def agenerate(self, req):
            seen.append(req.gconfig.seed)
            return req

    eng = _SeededEngine(Inner(), 1000)

    async def go():
        await asyncio.gather(*[eng.agenerate(ModelRequest([1], GenerationConfig())) for _ in range(3)])
        await eng.agenerate(ModelRequest([1], GenerationConfig(greedy=True)))
        await eng.agenerate(ModelRequest([1], GenerationConfig(seed=7)))

    asyncio.run(go())
    assert seen == [1000, 1001, 1002, None, 7] and eng.addresses == ["x"]


def test_step_threads_follow_the_bottleneck():
    """Sync steps take the rank's cores (the servers idle while it trains); async steps take one thread
    after a step that waited for generation, and otherwise the count whose recent steps were faster."""
    from areal_cli.utils.concurrency import StepThreads

    sync = StepThreads(2, sync=True)
    sync.observe(wait_s=1.0, step_s=1.5)
    assert sync.n == 2
    one = StepThreads(1, sync=False)
    one.observe(wait_s=0.0, step_s=1.0)
    assert one.n == 1
    remote = StepThreads(2, sync=False, shared=False)  # no server on this node: nothing to leave a core to
    remote.observe(wait_s=1.0, step_s=1.5)
    assert remote.n == 2


def _drive(threads, step_s: dict[int, float], steps: int) -> list[int]:
    """Ready-batch steps whose time depends only on the thread count they ran with; the counts used."""
    used = []
    for _ in range(steps):
        used.append(threads.n)
        threads.observe(wait_s=0.0, step_s=step_s[threads.n])
    return used


def test_async_step_threads_take_the_faster_count_and_reprobe():
    from areal_cli.utils.concurrency import StepThreads

    p, every = StepThreads.PROBES, StepThreads.REPROBE_EVERY
    for faster, slower in ((2, 1), (1, 2)):  # the 11.9M model's case, then the 0.5M model's
        a = StepThreads(2, sync=False)
        assert a.n == 1  # the first batch: the servers are still generating the next ones
        used = _drive(a, {faster: 0.1, slower: 0.13}, 3 * every)
        probes = used[: 2 * p]
        assert sorted(probes) == [1] * p + [2] * p, probes
        rest = used[2 * p:]
        assert abs(rest.count(slower) - len(rest) / every) <= 1 and rest.count(slower) >= 2, rest  # re-probes
        assert all(n == faster for n in rest[:every - 1]), rest
        a.observe(wait_s=0.5, step_s=1.0)  # a step that waited: generation is the bottleneck
        assert a.n == 1
    # The balance moves (longer answers make generation, and so the contended part, longer): the
    # re-probes and the recent-steps window follow it.
    a = StepThreads(2, sync=False)
    assert _drive(a, {2: 0.1, 1: 0.13}, 2 * every)[-every:].count(2) == every - 1  # one re-probe
    later = _drive(a, {2: 0.2, 1: 0.13}, 3 * every)
    assert later[-every:].count(1) >= every - 1, later


def test_cpu_trainer_gets_its_share_of_the_cores_and_a_spin_for_its_steps():
    from areal_cli.launchers.local import train_thread_env
    from areal_cli.utils.concurrency import cores_per_rank

    cores = len(os.sched_getaffinity(0))
    assert train_thread_env("cpu", 1) == ({"GOMP_SPINCOUNT": "20000"} if cores > 1 else {})
    assert train_thread_env("cpu", 2 * cores) == {}  # one core per rank: no OpenMP workers to spin
    assert cores_per_rank(cores) == 1 and cores_per_rank(2 * cores) == 1
    assert train_thread_env("cuda", 1) == {}


def test_a_trainer_rank_derives_its_step_threads_from_the_layout(monkeypatch):
    """No launcher-to-trainer variable: the share of the cores and whether servers share the rank's node
    come from the layout (rank // nproc_per_node is the node) and this process's cores."""
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.trainer.rl import step_threads

    monkeypatch.delenv("AREAL_TRAIN_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    cfg = ExperimentConfig()
    cfg.cluster.device, cfg.rollout.max_head_offpolicyness = "cpu", 2  # async: a shared node's steps adapt
    # two trainer nodes of 2 ranks each, the one server on node 1
    layout = JobLayout(n_nodes=3, device="cpu", servers=[ServerSpec(index=0, node=1)],
                       trainer=TrainerSpec(dp=4, nnodes=2, nproc_per_node=2, first_node=1))
    got = [step_threads(cfg, layout, r) for r in range(4)]
    assert [t.most for t in got] == [4, 4, 4, 4]
    assert [t.always for t in got] == [False, False, True, True]  # ranks 2-3 on node 2: no server there
    cfg.launcher.name = "ray"  # Ray's actors keep the CPUs Ray granted them
    assert step_threads(cfg, layout, 0) is None
    monkeypatch.setenv("AREAL_TRAIN_THREADS", "1")  # the user's knob, under any launcher
    assert step_threads(cfg, layout, 0).n == 1
    cfg.cluster.device = "cuda"
    assert step_threads(cfg, layout, 0) is None


def test_a_process_that_forgets_the_group_still_destroys_it_at_exit():
    """init_distributed registers the teardown: a process that exits with its gloo group alive can abort in
    interpreter teardown (SIGABRT, "terminate called without an active exception")."""
    import subprocess

    script = ("import torch.distributed as dist\n"
              "from areal_cli.utils.dist import init_distributed\n"
              "init_distributed('gloo')\n"
              "real = dist.destroy_process_group\n"
              "def traced(*a, **k):\n"
              "    print('destroyed', dist.is_initialized(), flush=True)\n"
              "    return real(*a, **k)\n"
              "dist.destroy_process_group = traced\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "destroyed True"


def test_stream_items_carry_their_position_outside_the_data():
    """The workflow sees the dataset row and nothing else; the position travels as an attribute, also
    through pickling (a process-based rollout worker)."""
    import pickle

    from areal_cli.rollout.data_stream import PromptStream, position

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    items = PromptStream(rows, seed=3).take(7)
    assert sorted(it.pos for it in items) == list(range(7))
    for it in items:
        assert set(it) == {"question", "answer"} and dict(it) in rows
        back = pickle.loads(pickle.dumps(it))
        assert back == it and position(back) == it.pos
    assert position({"question": "q"}) is None
