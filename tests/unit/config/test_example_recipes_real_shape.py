"""The GPU recipes of examples/ as shipped: each experiment composes and validates offline into the plan its
README describes, with a real model's values (no toy-values warning, nothing over a device's memory), and the
commands printed in the READMEs compose too, so they cannot drift from the configs.

The smoke runs of the same experiments (the CPU override, two steps) are in
tests/integration/examples/test_examples_recipes.py (marker `examples`)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from example_readme import areal_commands, first_command

from areal_cli.allocation.estimate import ModelFacts
from areal_cli.cli.common import compose_and_validate
from areal_cli.plan.packages import ENGINE_NEEDS, findable
from areal_cli.allocation.hardware import resolve_hardware

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
MEMORY_WARNINGS = ("exceeds the device", "weights need", "KV cache holds")
# Planned from this laptop, a GPU recipe's data and engine/backend packages (sglang, megatron-core) live on the
# cluster: validate says so and moves on.
ANYWHERE_WARNINGS = ("is not visible on this machine", "the nodes that run this plan need it")


@dataclass(frozen=True)
class Recipe:
    folder: str
    experiment: str
    model: str                       # the model preset
    path: str                        # what the run loads
    params_b: tuple[float, float]    # total parameters (billions), from the model card
    spec: str                        # the canonical allocation the plan must end with
    engine: str
    algo: str
    launcher: str
    nodes: int
    expect: dict = field(default_factory=dict)         # dotted config key -> value the README promises
    allowed_warnings: tuple[str, ...] = ()              # substrings of the only warnings the plan may carry


ONE_NODE = "sglang:d4+fsdp:d4"
RECIPES = [
    Recipe("gsm8k_grpo_1node", "gsm8k_grpo_1node", "qwen2_5_1_5b", "Qwen/Qwen2.5-1.5B-Instruct", (1.50, 1.58),
           ONE_NODE, "fsdp", "grpo", "local", 1,
           {"algo.kl_coef": 0.001, "algo.ppo_n_minibatches": 4, "rollout.group_size": 8,
            "dataset.train_path": "data/gsm8k/train.jsonl"}),
    Recipe("gsm8k_grpo_megatron_2node", "gsm8k_grpo_megatron_2node", "qwen2_5_7b", "Qwen/Qwen2.5-7B-Instruct",
           (7.5, 7.7), "sglang:d4+megatron:d2t2p2", "megatron", "grpo", "slurm", 2,
           {"engine.megatron.use_distributed_optimizer": True}),
    Recipe("ppo_critic", "ppo_critic", "qwen2_5_0_5b", "Qwen/Qwen2.5-0.5B-Instruct", (0.47, 0.51), ONE_NODE,
           "fsdp", "ppo", "local", 1,
           {"algo.use_critic": True, "algo.adv_estimator": "gae", "algo.critic_lr": 1e-5, "algo.optim.lr": 1e-6,
            "algo.batch_size": 256, "rollout.group_size": 1, "algo.ppo_n_minibatches": 4}),
    Recipe("dapo", "dapo", "qwen2_5_1_5b", "Qwen/Qwen2.5-1.5B-Instruct", (1.50, 1.58), ONE_NODE, "fsdp", "dapo",
           "local", 1,
           {"algo.dynamic_sampling": True, "algo.eps_clip_high": 0.28, "algo.loss_agg": "token-mean",
            "algo.kl_coef": 0.0, "algo.overlong_buffer_ratio": 0.2, "algo.ppo_n_minibatches": 16,
            "algo.optim.warmup_steps": 10}),
    Recipe("lora_grpo", "lora_grpo", "qwen2_5_7b", "Qwen/Qwen2.5-7B-Instruct", (7.5, 7.7), ONE_NODE, "fsdp",
           "grpo", "local", 1,
           {"model.lora.rank": 32, "model.lora.alpha": 32.0, "model.lora.target_modules": "all",
            "algo.optim.lr": 3e-5}),
    Recipe("sft_then_rl", "sft_then_rl", "qwen2_5_1_5b", "Qwen/Qwen2.5-1.5B", (1.50, 1.58), ONE_NODE, "fsdp",
           "grpo", "local", 1,
           {"trainer.sft_warmup_steps": 58, "trainer.sft_batch_size": 128, "trainer.sft_lr": 2e-5}),
    Recipe("moe_qwen3_30b", "moe_qwen3_30b", "qwen3_30b_a3b", "Qwen/Qwen3-30B-A3B", (30.0, 31.0),
           "sglang:d4t4+megatron:(attn:d2t4p2|ffn:d1t1p2e8)", "megatron", "grpo", "slurm", 4,
           {"model.num_experts": 128, "model.num_experts_per_tok": 8, "rollout.gconfig.max_new_tokens": 2048},
           allowed_warnings=("rank order",)),
    Recipe("vlm", "vlm", "qwen2_5_vl_3b", "Qwen/Qwen2.5-VL-3B-Instruct", (3.70, 3.80), ONE_NODE, "fsdp", "grpo",
           "local", 1,
           {"dataset.train_path": "data/geometry3k/train.jsonl", "dataset.prompt_field": "problem",
            "dataset.image_key": "images", "workflow.reward": "math", "rollout.group_size": 4,
            "algo.batch_size": 32, "algo.eps_clip": 0.4, "algo.optim.lr": 2e-6},
           allowed_warnings=("model.vision: qwen2_5_vl_3b is a vision-language model",)),
    # The README's first command is the SLURM launch of gsm8k_grpo_1node.
    Recipe("launch_anywhere", "gsm8k_grpo_1node", "qwen2_5_1_5b", "Qwen/Qwen2.5-1.5B-Instruct", (1.50, 1.58),
           ONE_NODE, "fsdp", "grpo", "slurm", 1, {"launcher.slurm.partition": "gpu"}),
]
BY_FOLDER = {r.folder: r for r in RECIPES}
FOLDERS = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) if EXAMPLES.is_dir() else []


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_real_shape(recipe: Recipe, cfg, plan) -> None:
    """What a recipe for real GPUs must be, whichever command produced it."""
    assert cfg.model.name == recipe.model and cfg.model.path == recipe.path
    params = ModelFacts.from_config(cfg.model).total_params() / 1e9
    lo, hi = recipe.params_b
    assert lo <= params <= hi, f"{recipe.model}: {params:.2f}B parameters, the model card says {recipe.params_b}"
    assert cfg.cluster.device == "cuda" and resolve_hardware(cfg).mem_gb == 80
    assert cfg.cluster.n_nodes == recipe.nodes and cfg.cluster.n_gpus_per_node == 8
    assert plan.spec == recipe.spec
    assert cfg.engine.name == recipe.engine and [t.backend for t in plan.trains] == [recipe.engine]
    assert cfg.algo.name == recipe.algo and cfg.launcher.name == recipe.launcher
    assert cfg.engine.dtype == "bfloat16"
    assert cfg.rollout.gconfig.max_new_tokens >= 512
    # long decodes make generation the longer phase: a second batch in flight (rollout=generation_bound)
    assert cfg.rollout.max_head_offpolicyness == 2
    assert cfg.algo.optim.lr <= (1e-4 if cfg.model.lora.rank > 0 else 1e-5)
    assert cfg.trainer.sft_warmup_steps == 0 or cfg.trainer.sft_lr <= 1e-4
    for key, want in recipe.expect.items():
        assert _get(cfg, key) == pytest.approx(want) if isinstance(want, float) else _get(cfg, key) == want, key
    assert not [w for w in plan.warnings if "toy-sized" in w], plan.warnings
    assert not [w for w in plan.warnings if any(m in w for m in MEMORY_WARNINGS)], plan.warnings
    allowed = recipe.allowed_warnings + ANYWHERE_WARNINGS
    unexpected = [w for w in plan.warnings if not any(a in w for a in allowed)]
    assert not unexpected, unexpected
    for t in plan.trains:  # the estimate, not only the absence of its warning
        assert t.memory is not None and t.memory.total_gb < t.memory.device_gb, (t.name, t.memory)
    for p in plan.inferences:
        assert p.memory is not None and p.memory.weights_gb < p.memory.device_gb
        assert p.memory.kv_tokens >= p.memory.kv_tokens_needed, (p.name, p.memory)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.folder == r.experiment], ids=lambda r: r.experiment)
def test_experiment_as_shipped_is_a_real_gpu_recipe(recipe):
    cfg, plan = compose_and_validate([f"experiment={recipe.experiment}"])
    _check_real_shape(recipe, cfg, plan)
    assert cfg.experiment_name == recipe.experiment


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.folder)
def test_readme_command_is_the_recipe(recipe):
    readme = EXAMPLES / recipe.folder / "README.md"
    cmd = first_command(readme)
    assert cmd is not None and cmd.command == "train", f"{readme}: no `areal train` in the first bash block"
    assert cmd.experiment == recipe.experiment and not cmd.config_dirs
    cfg, plan = compose_and_validate(cmd.overrides)
    _check_real_shape(recipe, cfg, plan)
    text = readme.read_text()
    assert f"spec {plan.spec}" in text  # the pasted plan or dry-run excerpt shows the current spec
    if recipe.folder == recipe.experiment:
        assert f"conf/experiment/{recipe.experiment}.yaml" in text
        for t in plan.trains:  # the pasted plan table carries the current estimate
            assert f"{t.memory.total_gb:.2f} GB" in text, f"{readme}: paste the plan again (validate-config)"


@pytest.mark.parametrize("folder", [r.folder for r in RECIPES])
def test_every_command_in_a_recipe_readme_composes(folder):
    """The CPU try-outs, the long spellings and the launcher variants as well as the main command."""
    cmds = areal_commands(EXAMPLES / folder / "README.md")
    assert len(cmds) >= 2, "a recipe README shows its command and the CPU smoke override"
    recipe = BY_FOLDER[folder]
    # a CPU try runs here, so it needs the engine's package in this Python (plan/packages.py)
    need = ENGINE_NEEDS.get(recipe.engine)
    lacking = need is not None and not findable(need.module)
    for cmd in cmds:
        if lacking and "cluster=local_cpu" in cmd.overrides:
            continue
        cfg, _ = compose_and_validate(cmd.overrides)
        assert cfg.experiment_name == (cmd.experiment or cfg.experiment_name)
    if recipe.folder != recipe.experiment:  # launch_anywhere: its CPU try is a dry run per launcher
        dry = {o.split("=", 1)[1] for c in cmds if "--dry-run" in c.flags for o in c.overrides
               if o.startswith("launcher=")}
        assert dry == {"slurm", "ray", "skypilot"}, dry
        return
    cpu = [c for c in cmds if "cluster=local_cpu" in c.overrides]
    assert cpu, "the README shows how to try the recipe on CPU"
    if lacking:
        pytest.skip(f"{need.dist} is not installed here, and the recipe's CPU try runs here")
    for c in cpu:  # the CPU try keeps the recipe's algorithm and engine
        cfg, _ = compose_and_validate(c.overrides)
        assert cfg.algo.name == recipe.algo and cfg.engine.name == recipe.engine and cfg.cluster.device == "cpu"


def test_every_recipe_folder_is_in_the_table():
    """A recipe folder that ships an experiment of its name must be listed above (so its facts are checked)."""
    shipped = {p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")}
    missing = [f for f in FOLDERS if f in shipped and f not in BY_FOLDER]
    assert not missing, f"add {missing} to RECIPES"
    assert set(BY_FOLDER) <= set(FOLDERS), "a RECIPES entry has no folder in examples/"


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_example_folder_has_a_readme_command_that_composes(folder, monkeypatch):
    """Every folder of examples/ (the recipes here, the code-bearing examples too): a README.md whose bash
    blocks hold an `areal train|validate-config experiment=...` that composes, with its --config-dir."""
    readme = EXAMPLES / folder / "README.md"
    assert readme.is_file(), f"examples/{folder} has no README.md"
    cmds = [c for c in areal_commands(readme) if c.experiment]
    assert cmds, f"examples/{folder}/README.md: no ```bash block with an `areal train experiment=...` command"
    cmd = cmds[0]
    monkeypatch.chdir(REPO)  # README paths (--config-dir examples/x/conf) are relative to the repository
    monkeypatch.setenv("AREAL_CONFIG_DIR", "")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if cmd.config_dirs:
        from areal_cli.plan.groups import add_config_dirs

        add_config_dirs(cmd.config_dirs)
    cfg, plan = compose_and_validate(cmd.overrides)
    assert plan.spec and cfg.experiment_name
    # the experiment chooses its staleness through the rollout group, so `rollout=sync` still means sync
    assert compose_and_validate([*cmd.overrides, "rollout=sync"])[0].rollout.max_head_offpolicyness == 0
