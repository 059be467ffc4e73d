"""Issue 22 item 10: every numeric knob of every config group declares its range next to the field,
and ``validate-config`` rejects a value outside it with the dotted path and the range."""

from __future__ import annotations

import math
import typing

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.config.ranges import Range, field_range, numeric_fields
from areal_cli.config.schema import ExperimentConfig
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError

FIELDS = numeric_fields(ExperimentConfig)


def test_the_walk_reaches_every_group():
    paths = {p for p, _, _ in FIELDS}
    for expected in ("seed", "algo.optim.lr", "algo.batch_size", "rollout.gconfig.top_p",
                     "rollout.eval_gconfig.temperature", "engine.max_tokens_per_mb",
                     "engine.deepspeed.zero_stage",
                     "workflow.reward_timeout_s", "cluster.n_nodes", "dataset.max_prompt_len",
                     "launcher.slurm.mem_gb", "model.hidden_size", "trainer.total_steps"):
        assert expected in paths
    assert "stats.live" not in paths and "algo.kl_in_reward" not in paths  # bools are not numbers


def test_every_numeric_field_declares_a_range():
    """Adding an int/float knob without ``ranged(...)`` fails here: declare its range next to it."""
    missing = [p for p, f, _ in FIELDS if field_range(f) is None]
    assert not missing, f"numeric config fields without a declared range: {missing}"


def _is_int(tp) -> bool:
    return tp is int or (int in typing.get_args(tp) and float not in typing.get_args(tp))


def outside(r: Range, tp) -> list:
    """Values just outside ``r`` (and NaN / inf for floats)."""
    step = 1 if _is_int(tp) else None
    vals = []
    if r.lo is not None:
        vals.append(r.lo if r.lo_open else r.lo - (step or max(abs(r.lo) * 1e-3, 1e-6)))
    if r.hi is not None:
        vals.append(r.hi if r.hi_open else r.hi + (step or max(abs(r.hi) * 1e-3, 1e-6)))
    if step is None:
        vals.append(math.nan)
        if r.hi is None:
            vals.append(math.inf)
    vals = [int(v) if step else v for v in vals]
    assert all(not r.contains(v) for v in vals)
    return [v for v in vals if v not in r.also]


@pytest.mark.parametrize("path,field,tp", FIELDS, ids=[p for p, _, _ in FIELDS])
def test_out_of_range_values_fail_with_the_path_and_the_range(path, field, tp):
    r = field_range(field)
    assert r is not None, f"{path} has no declared range"
    values = outside(r, tp)
    assert values, f"{path}: range {r} excludes nothing"
    for v in values:
        text = repr(v) if isinstance(v, float) and math.isfinite(v) else str(v)
        with pytest.raises(ConfigError) as ei:
            validate(load_config([f"{path}={text}"]))
        err = ei.value
        assert err.path == path, (path, v, str(err))
        assert str(r) in err.reason and err.hint, (path, v, str(err))


@pytest.mark.parametrize("override,path", [
    ("algo.optim.lr=-0.1", "algo.optim.lr"),
    ("rollout.gconfig.top_p=1.5", "rollout.gconfig.top_p"),
    ("rollout.gconfig.temperature=-2", "rollout.gconfig.temperature"),  # not "differs from algo.temperature"
    ("rollout.gconfig.top_k=0", "rollout.gconfig.top_k"),
    ("algo.kl_clamp=-1", "algo.kl_clamp"),
])
def test_issue_examples_are_range_errors(override, path):
    with pytest.raises(ConfigError) as ei:
        validate(load_config([override]))
    assert ei.value.path == path and "out of range" in ei.value.reason


def test_in_range_edges_pass():
    validate(load_config(["rollout.gconfig.top_k=-1", "rollout.gconfig.top_k=1", "rollout.gconfig.top_p=1.0",
                          "algo.kl_clamp=0", "algo.optim.grad_clip=0"]))


def test_docs_list_every_range():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    for path, field, _ in FIELDS:
        assert f"| `{path}` | `{field_range(field)}` | `{field.default}` |" in text, path
