"""The published GPU runs that ``benchmarks/plan_published.py`` checks the planner against must stay
expressible: each setup's overrides compose and validate on this tree (a renamed key, a preset that
changed shape or a new validation rule would otherwise only show up when someone runs the benchmark), and
the memory estimate must not say that runs which did happen on those GPUs cannot fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from plan_published import SETUPS  # benchmarks/ is not a package


@pytest.mark.parametrize("setup", SETUPS, ids=[s["id"] for s in SETUPS])
def test_published_setup_validates(setup):
    from areal_cli.cli.common import compose_and_validate

    cfg, plan = compose_and_validate(setup["overrides"])
    # The composed config is the setup described, not a default that swallowed an override.
    for o in setup["overrides"]:
        key, _, value = o.partition("=")
        if key == "rollout.max_head_offpolicyness":
            assert cfg.rollout.max_head_offpolicyness == int(value)
        elif key == "algo.batch_size":
            assert cfg.algo.batch_size == int(value)
        elif key == "cluster.n_nodes":
            assert cfg.cluster.n_nodes == int(value)
    spec = next(o.split("=", 1)[1] for o in setup["overrides"] if o.startswith("allocation_mode="))
    assert plan.colocated == ("|" in spec.split("(")[0])
    # These runs happened on these GPUs: a memory estimate that says they cannot fit is the estimate's error.
    assert not [w for w in plan.warnings if "exceeds the device" in w], plan.warnings
    pub = setup["published"]
    assert pub["value"] > 0 and pub["unit"] == "s/step" and pub["source"]
