"""``areal plan`` against published GPU RL runs: the planner's step time beside the number a paper or a
project's docs report for the same setup.

    python benchmarks/plan_published.py --list     # the setups and their published numbers, no planner
    python benchmarks/plan_published.py            # compose + validate each setup, predict, compare
    python benchmarks/plan_published.py --json     # the same as JSON

Every published number below was read in its source (paths and commits in ``source``); nothing here is
estimated. Where a source leaves a setting unstated, the override that stands in for it says so in
``assumed`` — those are the places a mismatch may come from the setup rather than from the model.

Step times published as "hours for N steps" are converted to seconds per step (hours x 3600 / N); that
is the only arithmetic applied to a published number.

The planner predicts from ``rollout.gconfig.max_new_tokens`` (every response as long as allowed). RL
responses are not: where a source publishes the mean length, ``main()`` also predicts with
``max_new_tokens`` set to that mean (all responses at the mean: no long tail, so this one errs fast).

Hardware: H800 (AReaL) and H20 (verl) are built-in profiles (``allocation/hardware.py``) from the figures
NVIDIA's partners and the trade press quote (no NVIDIA datasheet exists for either): H800 is H100 compute
and HBM with NVLink cut to 400 GB/s; H20 a Hopper part with 148 TFLOPS dense BF16, 96 GB HBM3 at 4.0 TB/s
and full 900 GB/s NVLink.
"""

from __future__ import annotations

import argparse
import json
import sys

AREAL_BLOG = ("AReaL v0.3 blog, Table 2 'End-to-end comparison between asynchronous AReaL and synchronous "
              "AReaL' (https://github.com/inclusionAI/AReaL/blob/main/blog/AReaL_v0_3.md, read at "
              "4aef98d8d); the same experiment as arXiv 2505.24298")
AREAL_SETTINGS = ("batch 512 prompts x 16, 4 minibatches, max_new_tokens 8192, lr 2e-5: the note under the "
                  "blog's Table 3 (staleness ablation, same base model and 1000 PPO steps); Table 3's eta=0 "
                  "(42.0) and eta=4 decoupled (42.2) AIME24 scores equal Table 2's sync (42.0) and async "
                  "(42.2) rows, so these are taken to be the same runs")
AREAL_SPLIT = ("the Table 2 runs' GPU split is not published; used: the split AReaL's throughput benchmark "
               "builds for the same model (benchmark/verl_v0_3_0_post1_76084d3/build_cmd.py at 820ca49: 3/4 "
               "of the GPUs SGLang TP1, the rest the trainer with PP2 for 1.5B, PP4 for 7B), also for sync "
               "(eta=0), whose layout is likewise unstated")
AREAL_7B_SPLIT = ("on 24 nodes that rule gives a trainer of DP 12, which 512 prompts do not divide (our groups "
                  "stay on one DP rank): 128 SGLang GPUs + Megatron d16p4 on 64 here, 2/3 inference")
AREAL_GPU = ("Table 2 does not name the GPU; AReaL's 16-node runs in the v0.1 blog are 8 x H800 per node, "
             "so H800 is assumed")
VERL_DOC = ("verl docs, 'Fully async policy trainer', section 'Asynchronous Training on 7B Model' "
            "(https://github.com/volcengine/verl/blob/main/docs/advance/fully_async.md, read at b178a3cd5; "
            "also verl/experimental/fully_async_policy/README.md); run script "
            "verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh")
NEMO_DOC = ("NeMo-RL docs, Performance, 'NeMo RL v0.6 / H100 BF16 Benchmarks' "
            "(https://github.com/NVIDIA-NeMo/RL/blob/main/docs/about/performance-summary.md, read at "
            "7ea279abf); recipes examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-*.yaml at tag v0.6.0")

# The architecture of deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B is the qwen2_5_1_5b preset's except for
# untied embeddings (1.78B parameters, not 1.54B) and a 131072-token context.
_R1_1P5B = ["model=qwen2_5_1_5b", "model.tie_word_embeddings=false", "model.max_position_embeddings=131072"]
# deepseek-ai/DeepSeek-R1-Distill-Qwen-7B: the qwen2_5_7b preset's shape (Qwen2.5-Math-7B base) with a
# 131072-token context.
_R1_7B = ["model=qwen2_5_7b", "model.max_position_embeddings=131072"]
_AREAL_COMMON = ["algo.batch_size=512", "rollout.group_size=16", "algo.ppo_n_minibatches=4",
                 "rollout.gconfig.max_new_tokens=8192", "dataset.max_prompt_len=1024",
                 "engine.max_tokens_per_mb=32768", "engine.gradient_checkpointing=true",
                 "rollout.max_concurrent_rollouts=512", "cluster.device=cuda", "cluster.n_gpus_per_node=8",
                 "cluster.gpu_memory_gb=80", "cluster.hardware=h800", "launcher=slurm"]
# The NeMo-RL and verl runs serve with vLLM and refit its weights over NCCL; our vllm backend takes weights
# from disk only (config/rollout.py DISK_ONLY_BACKENDS), so these setups name sglang, whose distributed update
# is the same NCCL broadcast. Async setups admit (k+1) batches at once, as those systems' async engines do.
# verl's 7B fully-async script: vLLM TP4, FSDP2 with Ulysses SP4 (our fsdp 'c'), 2048 prompt + 28672
# response tokens, 512 prompts x 16 per step in 16 minibatches of 32 prompts, dynamic batch of
# (2048 + 28672) x 2 tokens per GPU for the actor.
_VERL_7B = ["model=qwen2_5_7b", "algo.batch_size=512", "rollout.group_size=16", "algo.ppo_n_minibatches=16",
            "rollout.gconfig.max_new_tokens=28672", "dataset.max_prompt_len=2048",
            "engine.max_tokens_per_mb=61440", "engine.gradient_checkpointing=true",
            "rollout.max_concurrent_rollouts=512", "cluster.device=cuda", "cluster.n_nodes=16",
            "cluster.n_gpus_per_node=8", "cluster.gpu_memory_gb=96", "cluster.hardware=h20", "launcher=slurm"]
# NeMo-RL v0.6 Qwen3-30B-A3B recipes: 64 prompts x 32 generations, 4096 tokens prompt + response,
# train_global_batch_size 512 samples (4 minibatches), sequence packing at 4096 tokens per micro-batch,
# no activation checkpointing, vLLM TP2, Megatron TP1 EP8.
_NEMO_30B = ["model=qwen3_30b_a3b", "algo.batch_size=64", "rollout.group_size=32", "algo.ppo_n_minibatches=4",
             "rollout.gconfig.max_new_tokens=3584", "dataset.max_prompt_len=512",
             "engine.max_tokens_per_mb=4096", "rollout.max_concurrent_rollouts=64", "cluster.device=cuda",
             "cluster.n_gpus_per_node=8", "cluster.gpu_memory_gb=80", "cluster.hardware=h100", "launcher=slurm"]
_NEMO_LEN = ("NeMo caps prompt + response at 4096 (T-Max Sequence Length; max_new_tokens = 4096 capped by "
             "vLLM max_model_len); the prompt/response split 512/3584 is ours, not published")
_NEMO_MEAN = ("'G-Average Seq len' (average of 5 steps); the table does not say whether it counts the prompt. "
              "1102 tok/s/GPU x 32 GPUs x 192 s = 6.77M tokens = 2048 x 3306, so the table's tokens/s counts "
              "whole sequences of about that length")


def _hours_per_steps(hours: float, steps: int) -> float:
    return round(hours * 3600.0 / steps, 2)


SETUPS: list[dict] = [
    {
        "id": "areal_1p5b_async_16n",
        "description": "AReaL async (eta=4, decoupled PPO), R1-Distill-Qwen-1.5B, 16x8 H800, SGLang + Megatron",
        "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (1.78B, dense)",
        "overrides": _R1_1P5B + _AREAL_COMMON + [
            "cluster.n_nodes=16", "allocation_mode=sglang:d96+megatron:d16p2", "rollout.max_head_offpolicyness=4"],
        "published": {"metric": "step_s", "value": _hours_per_steps(14.8, 1000), "unit": "s/step",
                      "raw": "14.8 training hours for 1000 PPO steps", "source": AREAL_BLOG,
                      "note": AREAL_GPU},
        "mean_response_tokens": None,  # only as a curve (v0.1 blog figure), not a number
        "assumed": [AREAL_SETTINGS, AREAL_SPLIT],
        "confidence": "medium",
    },
    {
        "id": "areal_1p5b_sync_16n",
        "description": "AReaL synchronous (eta=0), same model, cluster and steps as the async row",
        "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (1.78B, dense)",
        "overrides": _R1_1P5B + _AREAL_COMMON + [
            "cluster.n_nodes=16", "allocation_mode=sglang:d96+megatron:d16p2", "rollout.max_head_offpolicyness=0"],
        "published": {"metric": "step_s", "value": _hours_per_steps(41.0, 1000), "unit": "s/step",
                      "raw": "41.0 training hours for 1000 PPO steps", "source": AREAL_BLOG, "note": AREAL_GPU},
        "mean_response_tokens": None,
        "assumed": [AREAL_SETTINGS, AREAL_SPLIT],
        "confidence": "medium",
    },
    {
        "id": "areal_7b_async_24n",
        "description": "AReaL async, R1-Distill-Qwen-7B, 24x8 H800",
        "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (7.6B, dense)",
        "overrides": _R1_7B + _AREAL_COMMON + [
            "cluster.n_nodes=24", "allocation_mode=sglang:d128+megatron:d16p4", "rollout.max_head_offpolicyness=4"],
        "published": {"metric": "step_s", "value": _hours_per_steps(25.4, 1000), "unit": "s/step",
                      "raw": "25.4 training hours for 1000 PPO steps", "source": AREAL_BLOG, "note": AREAL_GPU},
        "mean_response_tokens": None,
        "assumed": ["batch, lengths and eta of the 7B runs are not published; the 1.5B runs' (" + AREAL_SETTINGS
                    + ") are used", AREAL_SPLIT, AREAL_7B_SPLIT],
        "confidence": "low",
    },
    {
        "id": "areal_7b_sync_24n",
        "description": "AReaL synchronous, R1-Distill-Qwen-7B, 24x8 H800",
        "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (7.6B, dense)",
        "overrides": _R1_7B + _AREAL_COMMON + [
            "cluster.n_nodes=24", "allocation_mode=sglang:d128+megatron:d16p4", "rollout.max_head_offpolicyness=0"],
        "published": {"metric": "step_s", "value": _hours_per_steps(57.7, 1000), "unit": "s/step",
                      "raw": "57.7 training hours for 1000 PPO steps", "source": AREAL_BLOG, "note": AREAL_GPU},
        "mean_response_tokens": None,
        "assumed": ["batch, lengths of the 7B runs are not published; the 1.5B runs' are used", AREAL_SPLIT,
                    AREAL_7B_SPLIT],
        "confidence": "low",
    },
    {
        "id": "verl_7b_colocate_sync_128",
        "description": "verl colocated sync DAPO, Qwen2.5-Math-7B, 128 H20, vLLM + FSDP2",
        "model": "Qwen/Qwen2.5-Math-7B (7.6B, dense; max_position_embeddings raised to 32768 by the script)",
        "overrides": _VERL_7B + ["allocation_mode=sglang:d32t4|fsdp:d32c4", "rollout.max_head_offpolicyness=0"],
        "published": {"metric": "step_s", "value": 356.30, "unit": "s/step",
                      "raw": "step 356.30 s (gen 177.85, old_log_prob 53.92, update_actor 113.81); "
                             "400 steps in 1d 16h 48m",
                      "source": VERL_DOC + ", table row 'colocate sync, 128'",
                      "note": "machine H20; the table's 'step' column: 400 x 356.30 s = 39.6 h against the "
                              "published 40.8 h total, so close to the run's mean step"},
        "mean_response_tokens": None,  # in the linked wandb project only
        "assumed": [("the colocated baseline's script is not published; vLLM TP4 and Ulysses SP4 of the "
                     "fully-async script are assumed"),
                    ("the fully-async script turns on DAPO's overlong buffer of 4096 (reward shaping only), "
                     "not dynamic sampling")],
        "confidence": "medium",
    },
    {
        "id": "verl_7b_fully_async_64_64",
        "description": "verl fully async (staleness 0.5, partial rollout), Qwen2.5-Math-7B, 64 rollout : 64 "
                       "train H20",
        "model": "Qwen/Qwen2.5-Math-7B (7.6B, dense)",
        "overrides": _VERL_7B + ["allocation_mode=sglang:d16t4+fsdp:d16c4", "rollout.max_head_offpolicyness=1",
                                 "rollout.max_concurrent_rollouts=1024"],
        "published": {"metric": "step_s", "value": 150.63, "unit": "s/step",
                      "raw": "step 150.63 s (gen 33.14, update_actor 113.16); 400 steps in 17h 22m (2.35x "
                             "over colocate sync 128)",
                      "source": VERL_DOC + ", table row 'fully_async_policy, 64:64'",
                      "note": "machine H20; one step = trigger_parameter_sync_step 4 x require_batches 4 x "
                              "mini-batch 32 = 512 prompts x 16"},
        "mean_response_tokens": None,
        "assumed": [("staleness_threshold=0.5 with partial rollouts has no exact counterpart: "
                     "max_head_offpolicyness=1 (at most one version behind at admission; verl's partial "
                     "rollouts may span more)")],
        "confidence": "medium",
    },
    {
        "id": "nemo_30b_a3b_onpolicy_32",
        "description": "NeMo-RL GRPO on-policy, Qwen3-30B-A3B, 4x8 H100 colocated, vLLM TP2 + Megatron EP8",
        "model": "Qwen/Qwen3-30B-A3B (30.5B total, 3.3B active, MoE 128 experts top-8)",
        "overrides": _NEMO_30B + ["cluster.n_nodes=4", "allocation_mode=sglang:d16t2|megatron:(attn:d32|ffn:d4e8)",
                                  "rollout.max_head_offpolicyness=0"],
        "published": {"metric": "step_s", "value": 192.0, "unit": "s/step",
                      "raw": "Total Step time 192 s; 1102 tokens/s/GPU; 32 GPUs",
                      "tokens_per_s_per_gpu": 1102.0, "source": NEMO_DOC + ", row 'GRPO Qwen3-30B3A On policy 32'",
                      "note": "average of 5 steps; G-GBS 2048, T-GBS 512"},
        "mean_response_tokens": 3203, "mean_response_note": _NEMO_MEAN,
        "assumed": [_NEMO_LEN],
        "confidence": "high",
    },
    {
        "id": "nemo_30b_a3b_1off_32",
        "description": "NeMo-RL async GRPO 1-step off, Qwen3-30B-A3B, 2 nodes vLLM TP2 + 2 nodes Megatron "
                       "PP2 EP8, H100",
        "model": "Qwen/Qwen3-30B-A3B (30.5B total, 3.3B active, MoE)",
        "overrides": _NEMO_30B + ["cluster.n_nodes=4", "allocation_mode=sglang:d8t2+megatron:(attn:d8p2|ffn:d1p2e8)",
                                  "rollout.max_head_offpolicyness=1", "rollout.max_concurrent_rollouts=128"],
        "published": {"metric": "step_s", "value": 152.0, "unit": "s/step",
                      "raw": "Total Step time 152 s; 1414 tokens/s/GPU; 32 GPUs",
                      "tokens_per_s_per_gpu": 1414.0, "source": NEMO_DOC + ", row 'GRPO Qwen3-30B3A 1-step Off 32'",
                      "note": "max_trajectory_age_steps 1, in-flight weight updates"},
        "mean_response_tokens": 3201, "mean_response_note": _NEMO_MEAN,
        "assumed": [_NEMO_LEN],
        "confidence": "high",
    },
    {
        "id": "nemo_30b_a3b_8off_192",
        "description": "NeMo-RL async GRPO 8-step off, Qwen3-30B-A3B, 8 nodes vLLM TP2 + 16 nodes Megatron "
                       "EP8, H100",
        "model": "Qwen/Qwen3-30B-A3B (30.5B total, 3.3B active, MoE)",
        "overrides": _NEMO_30B + ["cluster.n_nodes=24",
                                  "allocation_mode=sglang:d32t2+megatron:(attn:d64t2|ffn:d16e8)",
                                  "rollout.max_head_offpolicyness=8", "rollout.max_concurrent_rollouts=576"],
        "published": {"metric": "step_s", "value": 34.5, "unit": "s/step",
                      "raw": "Total Step time 34.5 s; 1025 tokens/s/GPU; 192 GPUs",
                      "tokens_per_s_per_gpu": 1025.0, "source": NEMO_DOC + ", row 'GRPO Qwen3-30B3A 8-step Off 192'",
                      "note": "max_trajectory_age_steps 8"},
        "mean_response_tokens": 3206, "mean_response_note": _NEMO_MEAN,
        "assumed": [_NEMO_LEN, ("NeMo trains with TP1 on 128 GPUs (attention DP 128); our validation keeps a "
                                "prompt's group on one DP rank, so 64 prompts allow DP <= 64: attention runs "
                                "d64t2 here")],
        "confidence": "medium",
    },
]

def hardware_of(setup: dict) -> str:
    for o in setup["overrides"]:
        if o.startswith("cluster.hardware="):
            return o.split("=", 1)[1]
    return "h100"


def predict(overrides: list[str], profile, mean_seq_tokens: float | None = None) -> dict:
    """The planner's step for the setup: at the config's caps (every completion runs to max_new_tokens), or
    with a published mean sequence length (prompt + response) as the mean, the caps still bounding the
    longest completion of a synchronous wave. ``implied_new_tokens``: the mean response length at which the
    prediction equals the published step time (bisection; the step time grows with it)."""
    from areal_cli.cli.common import compose_and_validate
    from areal_cli.planner.model import plan_config

    cfg, plan = compose_and_validate(overrides)
    prompt = max(1, cfg.dataset.max_prompt_len // 2)
    kw = {} if mean_seq_tokens is None else {"prompt_tokens": prompt, "new_tokens": mean_seq_tokens - prompt}
    step = plan_config(cfg, plan, profile, **kw).to_dict()["step"]
    return {k: step.get(k) for k in ("step_s", "samples_per_s", "tokens_per_s")}


def implied_new_tokens(overrides: list[str], profile, target_s: float) -> float | None:
    from areal_cli.cli.common import compose_and_validate
    from areal_cli.planner.model import plan_config

    cfg, plan = compose_and_validate(overrides)

    def at(n: float) -> float:
        return plan_config(cfg, plan, profile, new_tokens=n).step.step_s

    lo, hi = 1.0, float(cfg.rollout.gconfig.max_new_tokens)
    if not at(lo) <= target_s <= at(hi):
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < target_s else (lo, mid)
    return (lo + hi) / 2


def list_setups(as_json: bool) -> None:
    if as_json:
        print(json.dumps(SETUPS, indent=1))
        return
    for s in SETUPS:
        p = s["published"]
        print(f"{s['id']}  [{s['confidence']}]  {s['description']}")
        print(f"  published: {p['value']} {p['unit']}  ({p['raw']})")
        print(f"  source: {p['source']}")
        if s.get("mean_response_tokens"):
            print(f"  mean length: {s['mean_response_tokens']} tokens ({s['mean_response_note']})")
        print("  overrides: " + " ".join(s["overrides"]))
        for a in s["assumed"]:
            print(f"  assumed: {a}")
        print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the setups and published numbers only")
    ap.add_argument("--json", action="store_true", help="JSON output")
    ap.add_argument("--only", default="", help="comma-separated setup ids")
    args = ap.parse_args(argv)
    setups = [s for s in SETUPS if not args.only or s["id"] in args.only.split(",")]
    if args.list:
        list_setups(args.json)
        return 0

    from areal_cli.allocation.hardware import get_profile

    rows = []
    for s in setups:
        pub = s["published"]["value"]
        row = {"id": s["id"], "published_step_s": pub}
        try:
            prof, ov = get_profile(hardware_of(s)), s["overrides"]
            row["predicted"] = predict(ov, prof)
            if s.get("mean_response_tokens"):
                row["predicted_at_mean"] = predict(ov, prof, s["mean_response_tokens"])
            row["implied_new_tokens"] = implied_new_tokens(ov, prof, pub)
        except Exception as exc:  # noqa: BLE001 -- one setup's failure is a row, not the end of the table
            row["error"] = f"{type(exc).__name__}: {exc}"
        for key in ("predicted", "predicted_at_mean"):
            if row.get(key) and row[key].get("step_s"):
                row[f"ratio_{key}"] = round(row[key]["step_s"] / pub, 3)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'setup':28} {'published s':>11} {'predicted s':>11} {'ratio':>6} {'@mean s':>8} {'ratio':>6} "
          f"{'implied mean new tokens':>24}")
    for r in rows:
        if "error" in r:
            print(f"{r['id']:28} {r['published_step_s']:>11} error: {r['error']}")
            continue
        pm = r.get("predicted_at_mean") or {}
        print(f"{r['id']:28} {r['published_step_s']:>11} {r['predicted']['step_s']:>11.1f} "
              f"{r.get('ratio_predicted', float('nan')):>6.2f} "
              f"{pm.get('step_s') or float('nan'):>8.1f} {r.get('ratio_predicted_at_mean', float('nan')):>6.2f} "
              f"{r['implied_new_tokens'] or float('nan'):>24.0f}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
