"""The cost model of ``areal plan`` (planner/model.py, timing.py, memory.py): each term moves the way the
physics says when one knob moves, the sync step is the sum of its parts, and the JSON schema other tools
read is complete. Real composed configs through the real validator; no timings of this machine."""

from __future__ import annotations

import json

import pytest

from areal_cli.cli.common import compose_and_validate
from areal_cli.allocation.hardware import get_profile
from areal_cli.planner.model import plan_config

EXAMPLE = ["algo=grpo", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2", "cluster=gpu_2x8",
           "model=qwen2_5_7b"]


@pytest.fixture(autouse=True)
def _no_saved_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HARDWARE_DIR", str(tmp_path / "hw"))  # a calibrated profile must not leak in
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def planned(*overrides: str, hw="h100", **kw):
    cfg, plan = compose_and_validate(list(overrides))
    return plan_config(cfg, plan, get_profile(hw) if isinstance(hw, str) else hw, **kw)


def comp(rp, kind: str):
    return next(c for c in rp.components if c.kind == kind)


@pytest.mark.parametrize("base,hw", [(EXAMPLE, "h100"), ([], "cpu")])
def test_more_new_tokens_means_more_decode_and_a_longer_step(base, hw):
    short = planned(*base, "rollout.gconfig.max_new_tokens=16", hw=hw)
    long = planned(*base, "rollout.gconfig.max_new_tokens=64", hw=hw)
    assert long.step.decode_s > short.step.decode_s
    assert long.step.train_s > short.step.train_s
    assert long.step.sync_step_s > short.step.sync_step_s
    assert long.samples_per_s < short.samples_per_s


def test_larger_tp_means_less_memory_per_device():
    t1 = planned("model=qwen2_5_7b", "cluster=gpu_1x8", "engine=megatron", "allocation_mode=sglang:d2+megatron:d4")
    t2 = planned("model=qwen2_5_7b", "cluster=gpu_1x8", "engine=megatron",
                 "allocation_mode=sglang:d1t2+megatron:d2t2")
    assert comp(t2, "inference").memory.weights_gb == pytest.approx(comp(t1, "inference").memory.weights_gb / 2)
    assert comp(t2, "train").memory.process_gb < comp(t1, "train").memory.process_gb
    assert comp(t2, "train").memory.weights_gb < comp(t1, "train").memory.weights_gb


@pytest.mark.parametrize("base,hw", [(EXAMPLE, "h100"), ([], "cpu")])
def test_synchronous_step_is_the_sum_of_its_phases(base, hw):
    # the same training at k=0 and k=1: the objective pinned (at k>0 its default adds the proximal forward)
    base = [*base, "algo.use_decoupled_loss=false"]
    rp = planned(*base, "rollout.max_head_offpolicyness=0", hw=hw)
    s = rp.step
    assert s.mode == "sync"
    assert s.step_s == pytest.approx(s.gen_s + s.reward_s + s.train_s + s.sync_s)
    assert rp.samples_per_s == pytest.approx(rp.workload["samples"] / s.step_s)
    # what k=1 would give overlaps generation with the same training: faster, never faster than training
    assert s.train_s + s.sync_s <= s.async_step_s < s.sync_step_s
    k1 = planned(*base, "rollout.max_head_offpolicyness=1", hw=hw).step
    assert k1.mode == "async" and k1.step_s == pytest.approx(s.async_step_s)


def test_async_overlaps_generation_with_training_on_gpus_and_less_on_a_shared_cpu_host():
    gpu = planned(*EXAMPLE, "rollout.max_head_offpolicyness=2").step
    assert gpu.mode == "async"
    assert gpu.step_s == pytest.approx(max(gpu.gen_s + gpu.reward_s, gpu.train_s) + gpu.sync_s)
    # On the 2-core host the pools overlap, but slow each other while both run (measured on a quiet box:
    # async 0.643 s against sync 0.787 s per step, docs/plan.md)
    cpu = planned("rollout.max_head_offpolicyness=2", hw="cpu").step
    assert cpu.mode == "async" and cpu.step_s < cpu.sync_step_s
    # with more cores they slow each other less
    from dataclasses import replace

    wide = planned("rollout.max_head_offpolicyness=2", hw=replace(get_profile("cpu"), cores=8)).step
    assert wide.step_s < wide.sync_step_s
    assert wide.step_s >= max(wide.gen_s, wide.train_s) + wide.sync_s


def test_colocated_components_never_overlap():
    rp = planned("allocation_mode=hf:d1|fsdp:d1", "rollout.max_head_offpolicyness=2", hw="cpu")
    s = rp.step
    assert s.mode == "sync" and s.async_step_s == pytest.approx(s.sync_step_s)


def test_reference_and_critic_live_in_the_trainer_process():
    plain = comp(planned("algo.kl_coef=0", hw="cpu"), "train").memory
    ref = comp(planned("algo.kl_coef=0.1", hw="cpu"), "train").memory
    assert ref.weights_gb == pytest.approx(2 * plain.weights_gb) and ref.optim_gb == plain.optim_gb
    critic = planned("algo=ppo", hw="cpu")
    assert comp(critic, "train").memory.optim_gb > plain.optim_gb
    assert critic.step.train_s > planned("algo.kl_coef=0", hw="cpu").step.train_s


def test_a_trainer_that_cannot_fit_says_so_and_what_binds():
    rp = planned("model=qwen2_5_7b", "cluster=gpu_1x8", "engine=fsdp", "allocation_mode=sglang:d4+fsdp:d1",
                 "algo.batch_size=4", "engine.max_tokens_per_mb=4096")  # auto refuses a plan that cannot fit
    t = comp(rp, "train").memory
    assert not t.fits and not rp.fits and "over the device's" in t.binds
    assert any("over the device's" in w for w in rp.warnings)


def test_process_memory_includes_the_process_base():
    hw = get_profile("cpu")
    rp = planned(hw="cpu")
    for c in rp.components:
        m = c.memory
        assert m.process_gb >= hw.process_base_gb
        base = hw.process_base_gb if c.kind == "train" else hw.server_base
        assert m.process_gb == pytest.approx(m.weights_gb + m.grads_gb + m.optim_gb + m.activations_gb
                                             + m.kv_cache_gb + m.buffers_gb + base)


def test_known_lengths_replace_the_caps():
    capped = planned(hw="cpu")
    measured = planned(hw="cpu", prompt_tokens=10, new_tokens=6)
    assert measured.workload["prompt_tokens"] == 10 and measured.workload["new_tokens"] == 6
    assert measured.step.train_s < capped.step.train_s


def test_json_schema_has_every_key_other_tools_read():
    d = json.loads(json.dumps(planned(*EXAMPLE).to_dict()))
    assert {"hardware", "step", "samples_per_s", "tokens_per_s", "components", "bottleneck",
            "warnings"} <= set(d)
    assert d["hardware"]["name"] == "h100" and d["hardware"]["mem_bw_gbs"] > 0
    assert {"mode", "step_s", "gen_s", "prefill_s", "decode_s", "reward_s", "train_s", "sync_s", "sync_step_s",
            "async_step_s"} <= set(d["step"])
    assert d["step"]["mode"] in ("sync", "async")
    assert [c["kind"] for c in d["components"]] == ["inference", "train"]
    for c in d["components"]:
        assert {"name", "kind", "n_devices", "utilisation", "memory"} <= set(c)
        assert 0 <= c["utilisation"] <= 1
        assert {"weights_gb", "grads_gb", "optim_gb", "activations_gb", "kv_cache_gb", "process_gb", "total_gb",
                "device_gb", "binds"} <= set(c["memory"])
        assert isinstance(c["memory"]["binds"], str) and c["memory"]["binds"]
    assert isinstance(d["bottleneck"], str) and d["bottleneck"].count(".") <= 1


def test_bottleneck_names_the_pool_and_the_resource():
    gen_bound = planned(*EXAMPLE, "rollout.gconfig.max_new_tokens=4096", "dataset.max_prompt_len=256",
                        "engine.max_tokens_per_mb=8192", "algo.use_decoupled_loss=false",
                        "algo.batch_size=64")
    assert gen_bound.step.gen_s > gen_bound.step.train_s
    assert gen_bound.bottleneck.startswith("generation on 'sglang'")
    assert "trainer idles" in gen_bound.bottleneck
    train_bound = planned(*EXAMPLE, "rollout.gconfig.max_new_tokens=64")
    assert train_bound.bottleneck.startswith("training on 'megatron'")


def test_typical_trainer_memory_scales_activations_to_the_mean_lengths():
    one_mb = ("engine.max_tokens_per_mb=100000",)  # every sequence in one micro-batch
    caps = comp(planned(*one_mb, hw="cpu", prompt_tokens=64, new_tokens=16), "train").memory
    short = comp(planned(*one_mb, hw="cpu", prompt_tokens=16, new_tokens=8), "train").memory
    assert caps.expected_gb == pytest.approx(caps.process_gb)  # at the caps the typical step is the bound
    assert short.process_gb == pytest.approx(caps.process_gb)  # the bound does not move with the lengths
    share = (16 + 8) / (64 + 16)
    assert short.expected_gb == pytest.approx(short.process_gb - short.activations_gb * (1 - share))
    # several micro-batches: packing fills the fullest one to the budget whatever the mean length
    split = comp(planned("engine.max_tokens_per_mb=2048", hw="cpu", prompt_tokens=16, new_tokens=8), "train")
    assert split.memory.expected_gb == pytest.approx(split.memory.process_gb)


def test_the_hf_server_counts_its_fused_copy_slabs_and_push_staging():
    from areal_cli.allocation.estimate import GiB, ModelFacts

    dist = planned("rollout.weight_update=distributed", hw="cpu")
    disk = planned("rollout.weight_update=disk", hw="cpu")
    cfg, _ = compose_and_validate([])
    f = ModelFacts.from_config(cfg.model)
    w = f.total_params() * 4
    fused = w - f.vocab * f.hidden * (1 if f.tied else 2) * 4
    assert comp(disk, "inference").memory.buffers_gb == pytest.approx(fused / GiB)
    assert comp(dist, "inference").memory.buffers_gb == pytest.approx((fused + 2 * w) / GiB)
    # CUDA: no fast path (no fused copy); SGLang reserves its fraction and stages nothing of ours
    gpu = planned(*EXAMPLE)
    assert comp(gpu, "inference").memory.buffers_gb == 0.0


def test_slab_length_doubles_from_64_to_hold_the_longest_row():
    from areal_cli.planner.memory import _slab_len

    assert [_slab_len(n) for n in (1, 64, 65, 80, 128, 129, 1000)] == [64, 64, 128, 128, 128, 256, 1024]


def test_a_calibrated_tp_overhead_slows_tp_layouts_only():
    from dataclasses import replace

    t2 = ("cluster.n_gpus_per_node=3", "engine=archon", "allocation_mode=hf:d1+t2")
    d2 = ("cluster.n_gpus_per_node=3", "allocation_mode=hf:d1+d2")
    hw = get_profile("cpu")
    slow = replace(hw, tp_layer_s=0.02, tp_token_eff=0.5)
    a, b = planned(*t2, hw=hw).terms["train"], planned(*t2, hw=slow).terms["train"]
    assert b["compute_s"] == pytest.approx(2 * a["compute_s"])
    assert b["tp_comm_s"] > a["tp_comm_s"]
    assert planned(*d2, hw=slow).step.train_s == pytest.approx(planned(*d2, hw=hw).step.train_s)


def test_the_hf_servers_prefix_cache_is_counted_where_the_launcher_turns_it_on():
    from areal_cli.allocation.estimate import GiB, ModelFacts

    single = comp(planned(hw="cpu"), "inference").memory
    multi = planned("workflow=multi_turn", hw="cpu")
    capped = planned("workflow=multi_turn", "launcher.server_args=[--prefix-cache-tokens,100]", hw="cpu")
    cfg, _ = compose_and_validate(["workflow=multi_turn"])
    per_token = ModelFacts.from_config(cfg.model).kv_bytes_per_token(4)
    w = multi.workload
    stored = w["samples"] * (w["prompt_tokens"] + w["new_tokens"]) + w["prompts"] * w["prompt_tokens"]
    extra = comp(multi, "inference").memory.buffers_gb - single.buffers_gb
    assert extra == pytest.approx(stored * per_token / GiB)  # one weight version's stores, under the budget
    assert comp(capped, "inference").memory.buffers_gb - single.buffers_gb == pytest.approx(100 * per_token / GiB)


def test_a_judge_on_the_rollout_servers_adds_its_generation_to_the_step():
    plain = planned(hw="cpu")
    short = planned("workflow.reward=judge", "workflow.judge.max_new_tokens=8", hw="cpu")
    long = planned("workflow.reward=judge", "workflow.judge.max_new_tokens=64", hw="cpu")
    assert plain.step.reward_s == 0 < short.step.reward_s < long.step.reward_s
    assert long.step.sync_step_s == pytest.approx(plain.step.sync_step_s + long.step.reward_s, rel=1e-6)
    url = planned("workflow.reward=judge", "workflow.judge.server=url",
                  "workflow.judge.base_url=http://127.0.0.1:9", hw="cpu")
    assert url.step.reward_s == 0 and any("judge" in w for w in url.warnings)


def test_a_non_integer_prefix_cache_flag_is_one_config_error():
    from areal_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="launcher.server_args"):
        planned("workflow=multi_turn", "launcher.server_args=[--prefix-cache-tokens,lots]", hw="cpu")


def test_calibrated_training_rates_follow_the_width_and_the_micro_batch_size():
    """A calibrated CPU profile's train_mfu comes from points (hidden, tokens per micro-batch, mfu): the
    plan reads the one at the run's model width and micro-batch, log-linear between points."""
    from dataclasses import replace

    hw = get_profile("cpu")
    flat = replace(hw, train_mfu=0.5, train_mfu_points=[])
    pts = replace(hw, train_mfu=0.5, train_mfu_points=[[128, 500, 0.5], [128, 5000, 0.25], [256, 500, 1.0]])
    assert pts.train_mfu_at(128, 100) == 0.5 and pts.train_mfu_at(128, 50000) == 0.25
    assert pts.train_mfu_at(128, 500 * 10 ** 0.5) == pytest.approx(0.375)  # half-way in log tokens
    # between the widths: log-linear in the hidden size, each width's value taken at the tokens first
    assert pts.train_mfu_at(181, 500) == pytest.approx(0.5 + 0.5 * 0.5, abs=0.01)
    assert pts.train_mfu_at(4096, 5000) == 1.0 and flat.train_mfu_at(4096, 5000) == 0.5
    # the embedded default trains 16 prompts x 8 samples in one micro-batch: its tokens pick the point
    base = ("trainer.sft_warmup_steps=0", "engine.max_tokens_per_mb=auto")
    a = planned(*base, hw=flat, prompt_tokens=28.6).terms["train"]["compute_s"]
    b = planned(*base, hw=pts, prompt_tokens=28.6).terms["train"]["compute_s"]
    mb_tokens = 16 * 28.6 + 128 * 16  # the group's prompt once (shared prefix), every sample's answer
    assert b == pytest.approx(a * 0.5 / pts.train_mfu_at(128, mb_tokens))


def test_step_flops_count_the_vocabulary_projection_on_loss_positions_only_when_training():
    from dataclasses import replace

    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.planner.timing import step_flops

    f = ModelFacts(heads=4, kv_heads=2, layers=2, hidden=128, head_dim=32, intermediate=512, vocab=1000,
                   experts=0, moe_intermediate=0, tied=True)
    untied = replace(f, tied=False)
    head = 1000 * 128
    body = f.active_params() - head
    attn = 2 * 40 * 4 * 32
    # one forward-backward over 100 positions of which 30 carry loss; then one forward-only pass
    assert step_flops(f, 100, 30, 40, 1, 0) == 6 * ((body + attn) * 100 + head * 30)
    assert step_flops(f, 100, 30, 40, 0, 1) == 2 * (body + attn + head) * 100
    # an untied input embedding is a lookup: no FLOPs beyond the tied model's
    assert step_flops(untied, 100, 30, 40, 1, 1) == step_flops(f, 100, 30, 40, 1, 1)


def test_an_async_cpu_step_shares_the_cores_between_generation_and_training():
    """On a shared CPU host, while the server generates, every runnable thread gets the same share of the
    cores: the trainer's time grows by what that costs it (reported as its own part), a sync step has none."""
    from areal_cli.planner.model import _overlap

    # generation 1 s, training 3 s alone; while both run, generation at half speed and training at 1/1.2
    gen_end, train_end = _overlap(1.0, 2.0, 3.0, 1.2)
    assert gen_end == 2.0 and train_end == pytest.approx(2.0 + 3.0 - 2.0 / 1.2)
    assert _overlap(3.0, 1.0, 1.0, 2.0) == (pytest.approx(2.0 + 3.0 - 2.0), 2.0)  # training finishes first
    hw = get_profile("cpu")
    a = planned("trainer.sft_warmup_steps=0", hw=hw)
    s = planned("trainer.sft_warmup_steps=0", "rollout=sync", hw=hw)
    assert a.step.mode == "async" and a.terms["train"]["shared_s"] > 0
    assert a.step.train_s == pytest.approx(a.terms["train"]["total_s"])
    assert s.step.mode == "sync" and s.terms["train"]["shared_s"] == 0.0
    assert a.step.step_s < s.step.step_s  # overlap still pays
