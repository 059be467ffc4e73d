"""engines/megatron/parallel_state.py: the megatron engines of one process share mcore's process groups through
one explicit ParallelState (handed over as ``peers``), not a module-level list. The engine's own
``_init_parallel_state`` builds mcore's real groups under torch's in-process fake process group (two ranks,
t2, this process playing rank 0). Skips when megatron-core 0.16.1 is not installed.
"""

from __future__ import annotations

import functools
import warnings

import pytest

from areal_cli.engines.megatron import compat
from areal_cli.errors import ConfigError

pytestmark = pytest.mark.skipif(compat.installed_version() != compat.SUPPORTED_VERSION,
                                reason=f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                                       "(scripts/install_test_deps.sh installs it)")


@pytest.fixture
def rank0(monkeypatch):
    """Rank 0 of a fake 2-rank world, with mcore's extra gloo groups off (the fake store cannot back them)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as mpu
        from areal_cli.engines.megatron import engine
    monkeypatch.setattr(mpu, "initialize_model_parallel",
                        functools.partial(mpu.initialize_model_parallel, create_gloo_process_groups=False))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield mpu, engine
    finally:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        dist.destroy_process_group()


def _engine(engine_mod):
    return engine_mod.MegatronEngine.__new__(engine_mod.MegatronEngine)


def test_peers_share_one_state_and_the_last_one_out_destroys_it(rank0):
    mpu, me = rank0
    policy, critic = _engine(me), _engine(me)
    policy._init_parallel_state(2, 1, 1)
    critic._init_parallel_state(2, 1, 1, peers=(None, policy))
    assert critic.parallel_state is policy.parallel_state
    assert policy.parallel_state.engines == [policy, critic]
    policy.parallel_state.leave(policy)
    assert mpu.model_parallel_is_initialized()  # the critic still runs on the groups
    critic.parallel_state.leave(critic)
    assert not mpu.model_parallel_is_initialized()
    again = _engine(me)  # a later engine may make new groups
    again._init_parallel_state(1, 1, 1)
    assert again.parallel_state is not policy.parallel_state and mpu.get_tensor_model_parallel_world_size() == 1


def test_a_peer_with_another_layout_is_a_config_error(rank0):
    _, me = rank0
    policy, ref = _engine(me), _engine(me)
    policy._init_parallel_state(2, 1, 1)
    with pytest.raises(ConfigError, match="already runs megatron at t2p1e1; another engine asks for t1p1e1"):
        ref._init_parallel_state(1, 1, 1, peers=(policy,))
    assert policy.parallel_state.engines == [policy]


def test_an_engine_without_its_peers_does_not_take_over_their_groups(rank0):
    _, me = rank0
    policy, stray = _engine(me), _engine(me)
    policy._init_parallel_state(2, 1, 1)
    with pytest.raises(RuntimeError, match="initialize\\(peers=...\\)"):
        stray._init_parallel_state(2, 1, 1)
    assert policy.parallel_state.engines == [policy]
