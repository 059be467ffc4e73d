"""algo=rm through the config: it composes and validates without an inference component, and its one-line
refusals (an engine without a critic path, an SFT warm start on local pairs, a file without the pair columns)."""

from __future__ import annotations

import json

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError


def err(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(load_config(list(overrides)))
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("engine", ["fsdp", "archon", "deepspeed"])
def test_rm_validates_without_an_inference_component(engine):
    plan = validate(load_config(["algo=rm", f"allocation_mode.spec={engine}:d1", f"engine={engine}"]))
    assert not plan.inferences and plan.train.backend == engine


def test_rm_with_servers_warns_they_are_unused():
    plan = validate(load_config(["algo=rm"]))
    assert any("algo=rm does not generate" in w for w in plan.warnings)


def test_an_engine_without_a_critic_path_is_refused(tmp_path, monkeypatch):
    (tmp_path / "rm_plain_engine.py").write_text(
        "from areal_cli.api.engine_api import TrainEngine\n\n\nclass Engine(TrainEngine):\n    dims = 'd'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    e = err("algo=rm", "allocation_mode.spec=d1", "engine.name=rm_plain_engine:Engine")
    assert e.path == "engine" and "no critic path" in str(e) and "engine=fsdp" in str(e)


def test_a_plugin_engine_on_the_engine_base_has_the_critic_path():
    plan = validate(load_config(["algo=rm", "allocation_mode.spec=d1", "engine.name=plugin_engine:RecordingEngine"]))
    assert plan.train.backend == "plugin_engine:RecordingEngine"


def test_sft_warm_start_on_local_pairs_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"chosen": "a", "rejected": "b"}) + "\n")
    e = err("algo=rm", "allocation_mode.spec=fsdp:d1", f"dataset.train_path={path}", "trainer.sft_warmup_steps=5")
    assert e.path == "trainer.sft_warmup_steps"
    validate(load_config(["algo=rm", "allocation_mode.spec=fsdp:d1", f"dataset.train_path={path}",
                          "trainer.sft_warmup_steps=0"]))


def test_a_file_without_the_pair_columns_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"chosen": "a", "worse": "b"}) + "\n")
    e = err("algo=rm", "allocation_mode.spec=fsdp:d1", f"dataset.train_path={path}", "trainer.sft_warmup_steps=0")
    assert e.path == "dataset.rejected_field" and "'rejected' is not a column" in str(e)
