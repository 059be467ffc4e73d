"""A user's error crosses process boundaries (the rollout worker's pipe, Ray) as itself."""

from __future__ import annotations

import pickle

from areal_cli.engines.archon.tp_plans import NoTensorParallelPlan
from areal_cli.engines.megatron.model import UnsupportedModelError
from areal_cli.errors import ArealError, ConfigError
from areal_cli.rollout.worker import _portable


def test_config_errors_survive_a_pickle_round_trip():
    for err in (ConfigError("algo.dynamic_sampling", "6 groups in a row", "use other data", text="abc", column=1),
                NoTensorParallelPlan("gpt9"), UnsupportedModelError("no such family")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and isinstance(back, ArealError)
        assert str(back) == str(err) and back.to_dict() == err.to_dict()
        assert _portable(err) is err  # the worker sends it as itself, not as a RolloutError wrapping its text
    assert pickle.loads(pickle.dumps(NoTensorParallelPlan("gpt9"))).model_type == "gpt9"
