"""Smoke runs of the GPU recipes in examples/ on CPU: each experiment exactly as shipped, under the smoke
override of tests/support/example_smoke.py (tiny model, built-in arithmetic, the local CPU allocation, two
steps). The run must exit 0 with two train steps of finite loss, and its config.yaml must still carry what
makes the recipe that recipe (algorithm, engine, workflow, LoRA, critic, SFT phase, MoE model), so the smoke
override cannot silently replace it. The launchers are checked with `--dry-run` under their real names
(real SLURM and Ray runs live in the slurm and ray suites).

    python -m pytest -q -p no:cacheprovider -m examples tests/integration/examples

The random tiny model never answers the arithmetic right, so every numeric reward would be 0: nothing would
train, and DAPO's dynamic sampling would drop every group (until its patience runs out: the last test). The runs therefore use a reward
that varies with the completion (`examples_smoke_reward.varied_reward`, written next to the run); the
recipes' own reward (`numeric`) is covered by the unit tests of the reward and the default-suite runs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from example_smoke import REPO, smoke_overrides

pytestmark = pytest.mark.examples

REWARD_MODULE = "examples_smoke_reward"
REWARD = """
def varied_reward(prompt, completion, answer, **kw):
    return float(len(completion) % 3) / 2.0
"""


@dataclass(frozen=True)
class Smoke:
    experiment: str
    keeps: dict                                   # dotted config.yaml key -> the recipe's value
    extra: dict = field(default_factory=dict)     # beyond the shared smoke override (sizes only)
    moe: bool = False
    vision: bool = False                          # the tiny VLM (builtin:tiny_vl) on the built-in visual task
    metrics: tuple[str, ...] = ("train/loss",)    # finite on every train step


SMOKES = [
    Smoke("gsm8k_grpo_1node", {"algo.name": "grpo", "engine.name": "fsdp", "workflow.name": "rlvr",
                               "algo.kl_coef": 0.001, "algo.ppo_n_minibatches": 4, "algo.optim.lr": 1e-6,
                               "dataset.name": "gsm8k"}),
    Smoke("gsm8k_grpo_megatron_2node", {"algo.name": "grpo", "engine.name": "megatron",
                                        "engine.megatron.use_distributed_optimizer": True, "algo.kl_coef": 0.001,
                                        "rollout.gconfig.temperature": 1.0}),
    # PPO keeps its one sample per prompt: 4 prompts, one sequence in each of its 4 mini-batches.
    Smoke("ppo_critic", {"algo.name": "ppo", "algo.use_critic": True, "algo.adv_estimator": "gae",
                         "algo.critic_lr": 1e-5, "algo.ppo_n_minibatches": 4, "rollout.group_size": 1},
          extra={"rollout.group_size": 1, "algo.batch_size": 4},
          metrics=("train/loss", "critic/value_loss")),
    # DAPO's 16 mini-batches need 16 sequences: 8 prompts x 2.
    Smoke("dapo", {"algo.name": "dapo", "algo.dynamic_sampling": True, "algo.eps_clip_high": 0.28,
                   "algo.loss_agg": "token-mean", "algo.kl_coef": 0.0, "algo.ppo_n_minibatches": 16,
                   "algo.overlong_buffer_ratio": 0.2},
          extra={"algo.batch_size": 8}),
    Smoke("lora_grpo", {"algo.name": "grpo", "model.lora.rank": 32, "model.lora.alpha": 32.0,
                        "model.lora.target_modules": "all", "algo.optim.lr": 3e-5}),
    Smoke("sft_then_rl", {"algo.name": "grpo", "trainer.sft_batch_size": 8, "trainer.sft_lr": 2e-5},
          extra={"trainer.sft_warmup_steps": 4, "trainer.sft_batch_size": 8}),
    Smoke("moe_qwen3_30b", {"algo.name": "grpo", "engine.name": "megatron", "model.num_experts_per_tok": 2,
                            "model.num_experts": 4, "algo.kl_coef": 0.001},
          moe=True),
    # The VLM recipe on the tiny VLM and the built-in pictures (the hf server carries them on CPU).
    Smoke("vlm", {"algo.name": "grpo", "engine.name": "fsdp", "workflow.name": "rlvr", "algo.eps_clip": 0.4,
                  "algo.optim.lr": 2e-6, "model.name": "tiny_vl"},
          extra={"dataset.train_path": "builtin:count_all", "dataset.system_prompt": "null",
                 "dataset.max_prompt_len": 64},
          vision=True, metrics=("train/loss", "data/image_rows")),
]


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def _run(args: list[str], tmp_path: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD)
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], check=False,
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("smoke", SMOKES, ids=lambda s: s.experiment)
def test_recipe_smoke_run(smoke, tmp_path, tiny_model_dir, moe_model):
    if smoke.keeps.get("engine.name") == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core 0.16.1 is not installed (scripts/install_test_deps.sh installs it)")
    model_dir = moe_model if smoke.moe else "builtin:tiny_vl" if smoke.vision else tiny_model_dir
    extra = dict(smoke.extra)
    extra["workflow.reward"] = f"{REWARD_MODULE}.varied_reward"
    model = "tiny_moe" if smoke.moe else "tiny_vl" if smoke.vision else "tiny"
    over = smoke_overrides(tmp_path / "fileroot", model_dir, model=model, **extra)
    t0 = time.perf_counter()
    p = _run([f"experiment={smoke.experiment}", *over], tmp_path)
    print(f"\n[examples] {smoke.experiment}: smoke run {time.perf_counter() - t0:.1f} s wall", flush=True)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]

    run_dir = tmp_path / "fileroot" / "runs" / "smoke" / "t0"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, want in smoke.keeps.items():
        got = _get(cfg, key)
        assert got == (pytest.approx(want) if isinstance(want, float) else want), (key, got, want)
    assert _get(cfg, "model.path") == model_dir and _get(cfg, "allocation_mode.spec") == "hf:d1+d1"

    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for m in smoke.metrics:
            assert m in r and math.isfinite(r[m]), (m, r.get(m))
    if smoke.experiment == "lora_grpo":  # the adapter was trained and exported beside the merged model
        assert (run_dir / "checkpoints" / "final" / "lora_adapter" / "adapter_config.json").is_file()
    if smoke.experiment == "sft_then_rl":  # the SFT phase ran first, in the same command
        sft = [r for r in recs if r["kind"] == "sft"]
        assert [r["step"] for r in sft] == [1, 2, 3, 4] and all(math.isfinite(r["sft/loss"]) for r in sft)
        assert recs.index(sft[-1]) < recs.index(train[0])
        assert (run_dir / "sft_warmup" / "done.json").is_file()
    if smoke.experiment == "dapo":  # every accepted group had two distinct rewards
        assert all(r["train/adv_abs_mean"] > 0 for r in train)


def test_reward_model_recipe_smoke_runs(tmp_path, tiny_model_dir):
    """examples/reward_model's two steps, each as shipped under the smoke override: algo=rm on the built-in
    pairs, then GRPO scored by that run's export alone (combine=rm_only, as the recipe ships)."""
    root = tmp_path / "fileroot"
    # the experiment names its spec (fsdp:d8, no server): the CPU's one trainer process instead
    over = smoke_overrides(root, tiny_model_dir, **{"trial_name": "rm", "allocation_mode.spec": "fsdp:d1"})
    p = _run(["experiment=reward_model_train", *over], tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    export = root / "runs" / "smoke" / "rm" / "checkpoints" / "final"
    assert (export / "value_head.safetensors").is_file()
    over = smoke_overrides(root, tiny_model_dir, **{"workflow.reward": f"{REWARD_MODULE}.varied_reward",
                                                     "workflow.reward_model.path": str(export)})
    p = _run(["experiment=reward_model_rl", *over], tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run_dir = root / "runs" / "smoke" / "t0"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["workflow"]["reward_model"]["combine"] == "rm_only" and cfg["algo"]["name"] == "grpo"
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # rm_only: the reward trained on is the reward model's score
        assert math.isfinite(r["reward/rm_mean"]) and r["reward/mean"] == pytest.approx(r["reward/rm_mean"], abs=1e-5)
        assert math.isfinite(r["train/loss"]) and "reward/rule_mean" in r


def test_dapo_on_data_the_model_never_solves_stops_in_one_line(tmp_path, tiny_model_dir):
    """The recipe's own numeric reward on the random tiny model: every group is flat, so dynamic sampling
    could never fill a batch. The run must stop with the one-line error (raised in the rollout worker,
    crossing to the trainer and the CLI as itself), not hang and not print a traceback."""
    over = smoke_overrides(tmp_path / "fileroot", tiny_model_dir, **{"algo.batch_size": 8,
                                                                    "algo.dynamic_sampling_patience": 1})
    p = _run(["experiment=dapo", *over], tmp_path, timeout=600)
    assert p.returncode == 1, (p.stdout + p.stderr)[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "algo.dynamic_sampling: " in errors[0] and "groups in a row" in errors[0], \
        p.stderr[-3000:]
    assert "Traceback" not in p.stderr


# --------------------------------------------------------------------------- launchers, dry run only

def _dry(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    p = _run(["--dry-run", f"cluster.fileroot={tmp_path / 'shared'}", *args], tmp_path, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p


@pytest.mark.parametrize("experiment,nodes,time_min", [("gsm8k_grpo_1node", 1, 720),
                                                       ("gsm8k_grpo_megatron_2node", 2, 720),
                                                       ("moe_qwen3_30b", 4, 1440)])
def test_slurm_dry_run_prints_the_sbatch_script(experiment, nodes, time_min, tmp_path):
    extra = ["launcher=slurm", "launcher.slurm.time_min=720"] if experiment == "gsm8k_grpo_1node" else []
    p = _dry([f"experiment={experiment}", "launcher.slurm.partition=gpu", *extra], tmp_path)
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", f"#SBATCH --time={time_min}", "#SBATCH --requeue"):
        assert line in p.stdout, (line, p.stdout)
    # An unnamed run is named by its start time (cli/resume.py), the dry run shows the name it would take.
    assert re.search(rf"^#SBATCH --job-name=areal-{experiment}-\d{{8}}-\d{{6}}$", p.stdout, re.M), p.stdout
    assert "-m submitit.core._submit" in p.stdout and "launcher=slurm" in p.stderr


def test_ray_dry_run_prints_the_placement_groups(tmp_path):
    p = _dry(["experiment=gsm8k_grpo_1node", "launcher=ray", "launcher.ray.cpus_per_gpu=8"], tmp_path)
    groups = {g["name"]: g for g in json.loads(p.stdout)["placement_groups"]}
    assert set(groups) == {"inference", "trainer"}
    for g in groups.values():  # sglang:d4 and fsdp:d4, one GPU and 8 CPUs per bundle, all on plan node 0
        assert g["bundles"] == [{"GPU": 1.0, "CPU": 8.0}] * 4 and g["plan_nodes"] == [0] * 4
        assert g["strategy"] == "STRICT_PACK"


def test_skypilot_dry_run_prints_the_task(tmp_path):
    p = _dry(["experiment=gsm8k_grpo_1node", "launcher=skypilot"], tmp_path)
    task = yaml.safe_load(p.stdout)
    assert task["num_nodes"] == 1 and task["resources"]["accelerators"] == "H100:8"
    assert re.fullmatch(r"areal-gsm8k-grpo-1node-\d{8}-\d{6}", task["name"]), task["name"]
    assert str(tmp_path / "shared") in task["file_mounts"]
    assert "python -m areal_cli.launchers.skypilot node" in task["run"]
