"""Which recipe a run gets when the user names no experiment, and the warning for a toy recipe on a real model.

The CPU toy's recipe (tiny model, SFT warm start at lr 2e-3, 16 new tokens, float32) lives in
``experiment=cpu_default`` only, and a run gets it only when its model is a built-in toy. A real model
named without an experiment (``model=qwen2_5_7b``, or ``model.path=`` a local dir or a hub id) gets
``experiment=real_model`` instead: bf16, 1024 new tokens, no SFT warm start, lr 1e-6. Either way the
choice is printed as a plan note, and naming ``experiment=...`` turns the choice off.

:func:`toy_value_warnings` is the safety net for what the choice cannot see: a real model (over
``REAL_MODEL_PARAMS`` parameters) meeting the toy's values through an experiment made for the toy
(``experiment=cpu_default model=qwen2_5_7b``). Values the user set on the command line are theirs.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from areal_cli.config.algo import generates

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.config.schema import ExperimentConfig

TOY_EXPERIMENT = "cpu_default"
REAL_EXPERIMENT = "real_model"
REAL_MODEL_PARAMS = 100_000_000


def _model_path_of_option(option: str) -> str:
    from areal_cli.plan.fastcompose import Unsupported, _load_yaml
    from areal_cli.plan.groups import find_option

    f = find_option("model", option)
    if f is None:  # an unknown option is refused by the group check with its did-you-mean
        return ""
    try:
        _, data = _load_yaml(f)  # memoised per file: prepare() runs once per trial of a sweep
    except Unsupported:
        return ""  # malformed YAML: Hydra reports it when it composes
    return str(data.get("path", "")) if isinstance(data, dict) else ""


def _local_model_params(path: str) -> int | None:
    """Parameters of the model in a local HF dir (or a hub id's cached snapshot), from its config.json alone
    (None: neither is there to read).

    A small model saved to disk (a test's tiny model, a distilled toy) is still the toy: it keeps cpu_default."""
    import json

    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.config.model import HF_FACTS, ModelConfig, vision_facts
    from areal_cli.models.hub import cached_config, is_hub_id

    local = cached_config(path) if is_hub_id(path) else os.path.expanduser(path)  # a fetched hub model too
    if not local:
        return None
    f = os.path.join(local, "config.json")
    try:
        with open(f) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    m = ModelConfig()
    for fld, v in vision_facts(data).items():
        setattr(m.vision, fld, v)
    if isinstance(data.get("text_config"), dict):
        data = {**data, **data["text_config"]}
    for fld, keys in HF_FACTS.items():
        v = next((data[k] for k in keys if isinstance(data.get(k), (int, float, bool))), None)
        if v is not None:
            setattr(m, fld, bool(v) if fld == "tie_word_embeddings" else int(v))
    return ModelFacts.from_config(m).total_params()


def preset_for_path(path: str) -> str | None:
    """The model preset whose ``path`` is this hub id (``Qwen/Qwen2.5-7B-Instruct`` → ``qwen2_5_7b``), or None."""
    from areal_cli.plan.groups import group_options

    want = path.strip().strip("'\"").lower()
    for option in group_options()["model"]:
        if _model_path_of_option(option).lower() == want:
            return option
    return None


def preset_facts_known(cfg: ExperimentConfig) -> bool:
    """Whether the plan's architecture facts belong to a real model (a non-toy preset or a read config.json),
    not the tiny preset standing in for an unknown hub id."""
    return not _model_path_of_option(cfg.model.name).startswith("builtin:")


def check_model_facts(cfg: ExperimentConfig) -> None:
    """Refuse a plan whose architecture facts belong to the toy while ``model.path`` is a real hub model.

    That happens for ``model.path=<hub id>`` with no matching preset, before the snapshot is in the cache:
    the tiny preset's heads, layers and positions would stand in for the real model's, and every check and
    estimate after this one would be about the wrong model. ``areal train`` fetches first, so it never sees it.
    """
    from areal_cli.errors import ConfigError
    from areal_cli.models.hub import download_command, is_hub_id

    path = cfg.model.path
    if not is_hub_id(path) or preset_facts_known(cfg):
        return
    raise ConfigError("model.path", f"the architecture of {path} is unknown here: it is not in the Hugging Face "
                      "cache and no model preset names it, so validation would check the tiny model's facts",
                      f"fetch its config.json once ({download_command(path, None, 'config.json')}: kilobytes; "
                      "validate then reads it from the cache), or add model=<preset> of the same architecture")


def _run_name(text: str) -> str:
    """A run-dir-safe experiment name from a model option or path (``/m/Qwen2.5-7B`` → ``Qwen2.5-7B``)."""
    base = os.path.basename(os.path.normpath(text)) if "/" in text and not text.startswith(".") else text
    base = base.split("/")[-1]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("._-") or REAL_EXPERIMENT
    return name if re.match(r"[A-Za-z_]", name) else f"m_{name}"


def choose_experiment(choices: dict[str, str], values: dict[str, str], default_model: str) -> list[str]:
    """Overrides that pick the recipe for a run whose command line named no experiment.

    ``choices``: the groups the user chose (``{"model": "qwen2_5_7b"}``); ``values``: the plain key
    overrides (``{"model.path": "/models/x"}``). Returns ``[]`` for a toy model (the primary config's
    ``cpu_default`` stands), else ``experiment=real_model`` plus an ``experiment_name`` from the model.
    """
    if "experiment" in choices:
        return []
    option = choices.get("model", default_model)
    path = values.get("model.path")
    if path is not None:
        path = path.strip().strip("'\"")
        n = _local_model_params(path)
        toy = path.startswith("builtin:") or (n is not None and n <= REAL_MODEL_PARAMS)
    else:
        toy = _model_path_of_option(option).startswith("builtin:")
    if toy:
        return []
    out = [f"experiment={REAL_EXPERIMENT}"]
    if "experiment_name" not in values:
        out.append(f"experiment_name={_run_name(path if path is not None else option)}")
    return out


def recipe_note(hydra_overrides: list[str], explicit: bool) -> str | None:
    """The plan note saying which recipe was chosen for the user (None when they named one)."""
    if explicit:
        return None
    if f"experiment={REAL_EXPERIMENT}" in hydra_overrides:
        return (f"experiment={REAL_EXPERIMENT}: a real model with no experiment named gets bf16, 1024 new "
                "tokens, no SFT warm start and lr 1e-6 (conf/experiment/real_model.yaml); name an "
                "experiment to choose another recipe")
    return None


def toy_value_warnings(cfg: ExperimentConfig, explicit_keys: set[str]) -> list[str]:
    """One warning when a model of over 100M parameters runs with the CPU toy's values it was not given."""
    from areal_cli.allocation.estimate import ModelFacts

    n = ModelFacts.from_config(cfg.model).total_params()
    if n <= REAL_MODEL_PARAMS:
        return []
    lr_cap = 1e-3 if cfg.model.lora.rank > 0 else 1e-4  # adapters train at higher rates than full weights
    toy = {
        "experiment_name": cfg.experiment_name == TOY_EXPERIMENT,
        "engine.dtype": cfg.cluster.device == "cuda" and cfg.engine.dtype == "float32",
        "rollout.gconfig.max_new_tokens": generates(cfg.algo.name) and cfg.rollout.gconfig.max_new_tokens <= 64,
        "rollout.eval_gconfig.max_new_tokens": cfg.rollout.eval_gconfig.max_new_tokens <= 64,
        "trainer.sft_warmup_steps": cfg.trainer.sft_warmup_steps > 0 and cfg.trainer.sft_lr > 1e-4,
        "algo.optim.lr": cfg.algo.optim.lr > lr_cap,
    }
    values = {
        "experiment_name": cfg.experiment_name,
        "engine.dtype": cfg.engine.dtype,
        "rollout.gconfig.max_new_tokens": cfg.rollout.gconfig.max_new_tokens,
        "rollout.eval_gconfig.max_new_tokens": cfg.rollout.eval_gconfig.max_new_tokens,
        "trainer.sft_warmup_steps": f"{cfg.trainer.sft_warmup_steps} (trainer.sft_lr={cfg.trainer.sft_lr:g})",
        "algo.optim.lr": f"{cfg.algo.optim.lr:g}",
    }
    hits = [k for k, bad in toy.items() if bad and k not in explicit_keys]
    if not hits:
        return []
    listed = ", ".join(f"{k}={values[k]}" for k in hits)
    return [(f"model {cfg.model.name} ({n / 1e9:.2f}B parameters) runs with toy-sized values it was not "
             f"given on the command line: {listed} — these suit the tiny CPU model, not this one; drop the "
             f"toy experiment (a real model with none named gets experiment={REAL_EXPERIMENT}) or set them "
             "explicitly")]
