"""``engine.max_tokens_per_mb=auto`` and ``rollout.max_concurrent_rollouts=auto`` (issue 43 item 3): chosen from
the memory model with a margin by ``validate``, written into the config as ints, shown by ``validate-config``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from areal_cli.allocation import autosize
from areal_cli.allocation.estimate import companion_states
from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import _train_memory_at, validate
from areal_cli.errors import ConfigError

H100_7B = ["model=qwen2_5_7b", "cluster=gpu_1x8", "allocation_mode=gpu8_sglang_fsdp", "engine.max_tokens_per_mb=auto"]


def _validated(*overrides: str):
    cfg = load_config(list(overrides))
    return cfg, validate(cfg)


def _choice(plan, path: str) -> autosize.AutoChoice:
    return next(a for a in plan.auto if a.path == path)


def test_auto_becomes_an_int_the_engines_read():
    assert load_config([]).engine.max_tokens_per_mb == 4096  # the default: an int without validation
    cfg = load_config(["engine.max_tokens_per_mb=auto"])
    assert cfg.engine.max_tokens_per_mb == "auto"
    plan = validate(cfg)
    mb = plan.train.micro_batch
    assert isinstance(cfg.engine.max_tokens_per_mb, int) and mb.auto
    # The embedded default: one micro-batch per step, as the old 4096 gave (a step packs ~2400 tokens).
    assert cfg.engine.max_tokens_per_mb == mb.sequences * mb.max_seq_len and mb.n_micro_batches == 1
    assert _choice(plan, "engine.max_tokens_per_mb").bound == "minibatch"
    assert any(n.startswith("engine.max_tokens_per_mb=auto chose") for n in plan.notes)
    again = validate(cfg)  # the trainer validates the written config again: an int stays what it is
    assert not again.auto and cfg.engine.max_tokens_per_mb == mb.tokens_per_mb


@pytest.mark.parametrize("gb", [48, 80, 141])
def test_the_budget_is_the_largest_whole_number_of_sequences_within_the_margin(gb):
    cfg, plan = _validated(*H100_7B, f"cluster.gpu_memory_gb={gb}", "engine.gradient_checkpointing=true")
    mb, budget = plan.train.micro_batch, cfg.engine.max_tokens_per_mb
    seq = mb.max_seq_len
    assert budget % seq == 0 and budget >= seq
    total_gb, per_mini = _train_memory_at(cfg, load_facts(cfg), _train_component(cfg), gb, seq)
    k = budget // seq
    assert k <= per_mini
    assert total_gb(k) <= autosize.MEMORY_MARGIN * gb
    assert k == per_mini or total_gb(k + 1) > autosize.MEMORY_MARGIN * gb  # the largest that fits
    # the plan shows the chosen budget; the KL reference's weights live in the actor's process too
    extra = sum(companion_states(plan.train.memory, reference=cfg.algo.kl_coef > 0, critic=cfg.algo.use_critic))
    assert plan.train.memory.total_gb + extra == pytest.approx(total_gb(k))


def test_more_device_memory_never_gives_a_smaller_budget():
    budgets = [_validated(*H100_7B, f"cluster.gpu_memory_gb={gb}")[0].engine.max_tokens_per_mb
               for gb in (48, 64, 80, 96, 141, 192)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1], budgets


def test_the_budget_stops_at_a_minibatch_per_rank_and_leaves_every_pipeline_stage_work():
    cfg, plan = _validated("allocation_mode=hf:d1+archon:d1p2", "engine=archon", "cluster.n_gpus_per_node=3",
                           "engine.max_tokens_per_mb=auto")
    mb = plan.train.micro_batch
    per_mini = mb.sequences // cfg.algo.ppo_n_minibatches
    assert cfg.engine.max_tokens_per_mb == per_mini // 2 * mb.max_seq_len and mb.n_micro_batches == 2


def test_one_sequence_larger_than_the_device_is_an_error_naming_the_fix():
    with pytest.raises(ConfigError) as ei:
        _validated("model=qwen2_5_32b", "cluster=gpu_1x8", "allocation_mode=sglang:d1t4+fsdp:d4",
                   "algo.batch_size=8", "engine.dtype=bfloat16", "engine.max_tokens_per_mb=auto")
    err = ei.value
    assert err.path == "engine.max_tokens_per_mb" and "one sequence of" in err.reason
    assert "more than the device's 80.0 GB" in err.reason and "gradient_checkpointing" in err.hint
    # The same plan with an explicit budget is still only a warning (layouts can be explored).
    _, plan = _validated("model=qwen2_5_32b", "cluster=gpu_1x8", "allocation_mode=sglang:d1t4+fsdp:d4",
                         "algo.batch_size=8", "engine.dtype=bfloat16", "engine.max_tokens_per_mb=4096")
    assert any("exceeds the device" in w for w in plan.warnings)


def test_over_the_margin_but_within_the_device_is_one_sequence_and_a_warning():
    # Find a device size between "one sequence within 85%" and "one sequence within 100%".
    cfg = load_config(H100_7B)
    total_gb, _ = _train_memory_at(cfg, load_facts(cfg), _train_component(cfg), 80, 2048)
    gb = round(total_gb(1) / 0.92, 1)
    cfg, plan = _validated(*H100_7B, f"cluster.gpu_memory_gb={gb}")
    assert cfg.engine.max_tokens_per_mb == plan.train.micro_batch.max_seq_len
    assert _choice(plan, "engine.max_tokens_per_mb").bound == "over margin"
    assert any("even one sequence leaves less than 15%" in w for w in plan.warnings)


def test_largest_fitting_seqs_bounds():
    assert autosize.largest_fitting_seqs(lambda k: 10.0 + k, 100, 5.0) == 0  # not even one
    assert autosize.largest_fitting_seqs(lambda k: 10.0 + k, 100, 10_000.0) == 100  # capped
    assert autosize.largest_fitting_seqs(lambda k: 10.0 + k, 100, 47.5) == 37
    assert autosize.largest_fitting_seqs(lambda k: 1.0, 0, 5.0) == 0


def test_concurrency_from_the_kv_cache_the_staleness_bound_and_the_hf_cap():
    # sglang on 80 GB: the KV cache holds far more than the staleness bound admits.
    cfg, plan = _validated(*H100_7B, "rollout.max_concurrent_rollouts=auto")
    c = _choice(plan, "rollout.max_concurrent_rollouts")
    assert c.bound == "staleness"
    assert cfg.rollout.max_concurrent_rollouts == (cfg.rollout.max_head_offpolicyness + 1) * cfg.algo.batch_size
    # A small device: the KV cache binds, and what it holds (with the margin) is what is chosen.
    cfg, plan = _validated(*H100_7B, "rollout.max_concurrent_rollouts=auto", "cluster.gpu_memory_gb=48",
                           "rollout.group_size=32", "engine.gradient_checkpointing=true")
    inf = plan.inference
    episode = cfg.dataset.max_prompt_len + cfg.rollout.group_size * cfg.rollout.gconfig.max_new_tokens
    assert _choice(plan, "rollout.max_concurrent_rollouts").bound == "memory"
    assert cfg.rollout.max_concurrent_rollouts == \
        int(autosize.MEMORY_MARGIN * inf.memory.kv_tokens // episode) * inf.dp
    # The built-in hf server: the staleness bound or 64, whichever is smaller.
    cfg, plan = _validated("rollout.max_concurrent_rollouts=auto", "algo.batch_size=48")  # bound (1 + 1) x 48
    assert cfg.rollout.max_concurrent_rollouts == autosize.HF_CONCURRENCY
    assert _choice(plan, "rollout.max_concurrent_rollouts").bound == "hf cap"


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "validate-config", *args],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("compose", ["fast", "hydra"])
def test_the_cli_takes_auto_and_ints_and_refuses_anything_else_in_one_line(compose):
    env = {"AREAL_COMPOSE": compose}
    ok = _cli("engine.max_tokens_per_mb=8192", "--json", env_extra=env)
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    assert d["train"][0]["micro_batch"]["tokens_per_mb"] == 8192 and not d["train"][0]["micro_batch"]["auto"]
    assert d["auto"] == {}
    auto = _cli("engine.max_tokens_per_mb=auto", "rollout.max_concurrent_rollouts=auto", "--json", env_extra=env)
    assert auto.returncode == 0, auto.stderr
    d = json.loads(auto.stdout)
    assert d["train"][0]["micro_batch"]["auto"] is True
    assert d["auto"]["engine.max_tokens_per_mb"]["value"] == d["train"][0]["micro_batch"]["tokens_per_mb"]
    assert set(d["auto"]) == {"engine.max_tokens_per_mb", "rollout.max_concurrent_rollouts"}
    human = _cli("engine.max_tokens_per_mb=auto", env_extra=env)
    assert human.returncode == 0 and "(auto)" in human.stdout and "=auto chose" in human.stdout
    for bad in ("lots", "1.5", "0"):
        res = _cli(f"engine.max_tokens_per_mb={bad}", env_extra=env)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert lines[0].startswith("error: engine.max_tokens_per_mb") and "fix:" in lines[0], lines[0]
    res = _cli("rollout.max_concurrent_rollouts=many", env_extra=env)
    assert res.returncode == 1 and res.stderr.strip().startswith("error: rollout.max_concurrent_rollouts")


def load_facts(cfg):
    from areal_cli.allocation.estimate import ModelFacts

    return ModelFacts.from_config(cfg.model)


def _train_component(cfg):
    from areal_cli.allocation.parser import parse_allocation

    return parse_allocation(cfg.allocation_mode.spec).train[0]
