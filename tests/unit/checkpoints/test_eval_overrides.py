"""`areal eval`'s overrides onto a run's saved config (checkpoints/evaluate.apply_overrides), on the real
composed default config: key.path=value, the eval_gconfig shorthand, a swapped dataset option, and the
settings an evaluation may not change."""

from __future__ import annotations

import pytest

from areal_cli.checkpoints.evaluate import _alias, apply_overrides
from areal_cli.plan.compose import load_config
from areal_cli.errors import ConfigError


def test_values_shorthand_and_a_swapped_dataset():
    cfg = load_config(["dataset.test_size=50"])
    out = apply_overrides(cfg, [_alias("eval_gconfig.max_new_tokens=7"), "dataset=gsm8k", "dataset.eval_size=3"])
    assert out.rollout.eval_gconfig.max_new_tokens == 7 and out.rollout.eval_gconfig.greedy
    assert out.dataset.name == "gsm8k" and out.dataset.test_path == "data/gsm8k/test.jsonl"
    assert out.dataset.eval_size == 3 and out.dataset.test_size != 50  # the option's values, not the run's
    assert out.algo == cfg.algo and out.model == cfg.model


@pytest.mark.parametrize("override, path", [("algo=ppo", "algo"), ("dataset=nope", "dataset"),
                                            ("dataset.test_sise=5", "dataset.test_sise"),
                                            ("+dataset.x=1", "dataset.x")])
def test_refused_overrides_name_their_key(override, path):
    with pytest.raises(ConfigError) as e:
        apply_overrides(load_config([]), [override])
    assert e.value.path == path and e.value.hint, str(e.value)
