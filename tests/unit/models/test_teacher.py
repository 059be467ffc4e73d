"""The distillation teacher must read the student's tokens: same tokenizer (any size), else one line."""

from __future__ import annotations

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError
from areal_cli.models.teacher import check_teacher_tokenizer, resolve_teacher_path


@pytest.fixture(scope="module")
def bigger_teacher(tmp_path_factory, tiny_model_dir) -> str:
    """Another size (3 layers, wider), the student's tokenizer."""
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher_big"), tokenizer_dir=tiny_model_dir, seed=2,
                           num_layers=3, hidden_size=96, intermediate_size=192)


@pytest.fixture(scope="module")
def foreign_teacher(tmp_path_factory) -> str:
    """A tokenizer trained on other text: other ids for the same strings."""
    from areal_cli.models.tiny import make_tiny_model

    corpus = [f"the quick brown fox {i} jumps over {i * 7} lazy dogs; zebras graze." for i in range(300)]
    return make_tiny_model(tmp_path_factory.mktemp("teacher_foreign"), corpus=corpus, seed=0)


def test_same_tokenizer_other_size_is_accepted(tiny_model_dir, bigger_teacher):
    check_teacher_tokenizer(tiny_model_dir, bigger_teacher)


def test_other_tokenizer_is_one_line_naming_the_key(tiny_model_dir, foreign_teacher):
    with pytest.raises(ConfigError) as e:
        check_teacher_tokenizer(tiny_model_dir, foreign_teacher)
    msg = str(e.value)
    assert "algo.distill.teacher_path" in msg and foreign_teacher in msg and "tokenizer" in msg
    assert "\n" not in msg


def test_validate_refuses_the_foreign_teacher_and_accepts_the_bigger_one(tiny_model_dir, foreign_teacher,
                                                                           bigger_teacher):
    base = [f"model.path={tiny_model_dir}", "trainer.sft_warmup_steps=0"]
    plan = validate(load_config([*base, f"algo.distill.teacher_path={bigger_teacher}"]))
    assert plan.trains
    with pytest.raises(ConfigError, match="algo.distill.teacher_path.*cannot score the student's tokens"):
        validate(load_config([*base, f"algo.distill.teacher_path={foreign_teacher}"]))


def test_teacher_path_must_be_a_model(tmp_path):
    with pytest.raises(ConfigError, match="algo.distill.teacher_path.*freshly initialised"):
        resolve_teacher_path("builtin:tiny")
    with pytest.raises(ConfigError, match="algo.distill.teacher_path.*no config.json"):
        resolve_teacher_path(str(tmp_path))


def test_teacher_counts_in_the_memory_estimate(tiny_model_dir, bigger_teacher):
    from areal_cli.plan.distill import teacher_size_ratio

    base = [f"model.path={tiny_model_dir}", "trainer.sft_warmup_steps=0", "algo.kl_coef=0"]
    off = load_config(base)
    on = load_config([*base, f"algo.distill.teacher_path={bigger_teacher}"])
    ratio = teacher_size_ratio(on)
    assert teacher_size_ratio(off) == 0.0 and ratio > 1.0  # the teacher is the bigger model
    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.planner.memory import trainer_memory
    from areal_cli.planner.timing import train_passes

    part_off, part_on = validate(off).trains[0], validate(on).trains[0]
    facts = ModelFacts.from_config(on.model)
    w_off = trainer_memory(off, part_off, facts, 0.0).weights_gb
    w_on = trainer_memory(on, part_on, facts, 0.0).weights_gb
    # the plan holds the teacher's frozen weights beside the actor's, at the teacher's size
    assert w_on == pytest.approx(w_off + ratio * part_on.memory.weights_gb)

    assert train_passes(on)[1] == pytest.approx(train_passes(off)[1] + ratio)


def test_teacher_engine_must_be_a_training_engine(tiny_model_dir, bigger_teacher):
    base = [f"model.path={tiny_model_dir}", "trainer.sft_warmup_steps=0",
            f"algo.distill.teacher_path={bigger_teacher}"]
    with pytest.raises(ConfigError, match="algo.distill.engine.*unknown training engine"):
        validate(load_config([*base, "algo.distill.engine=bogus"]))
    assert validate(load_config([*base, "algo.distill.engine=fsdp"])).trains


def test_validate_config_counts_the_teacher_beside_the_actor(tiny_model_dir, bigger_teacher):
    """validate-config's per-device training table and its JSON hold the teacher's weights (and the KL
    reference's), not the actor's states alone."""
    from areal_cli.plan.distill import teacher_size_ratio

    base = [f"model.path={tiny_model_dir}", "trainer.sft_warmup_steps=0", "algo.kl_coef=0.04"]
    on = load_config([*base, f"algo.distill.teacher_path={bigger_teacher}"])
    part_off, part_on = validate(load_config(base)).trains[0], validate(on).trains[0]
    w = part_on.memory.weights_gb
    assert part_off.companions == pytest.approx((w, 0.0, 0.0))  # the KL reference alone
    assert part_on.companions == pytest.approx(((1 + teacher_size_ratio(on)) * w, 0.0, 0.0))
    assert part_on.total_gb == pytest.approx(part_on.memory.total_gb + part_on.companions[0])
    assert part_on.to_dict()["total_gb"] == pytest.approx(part_on.total_gb)
