"""ParallelDims: the one table of rank orders agrees with every engine's real mesh builder.

fsdp/deepspeed and archon: the real ``build_meshes`` / ``ArchonDims.build`` run once per rank under
torch's in-process "fake" process group (no processes, no gloo). megatron: the engine's own
``_init_parallel_state`` building mcore's real groups under the same fake group, and mcore's
``RankGenerator`` over many more layouts (pure python).
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from areal_cli.api.io_struct import ParallelStrategy
from areal_cli.api.parallel_dims import MEGATRON_PP_LAST, RANK_ORDERS, ParallelDims
from areal_cli.errors import ConfigError


def test_validation_is_typed():
    for bad in ({"tp": 0}, {"dp": -1}, {"pp": True}, {"ep": 1.5}, {"etp": 0}):
        with pytest.raises(ConfigError) as info:
            ParallelDims(**bad)
        assert info.value.path == "allocation_mode.spec" and info.value.hint
    with pytest.raises(ConfigError, match="has no tp dim"):
        ParallelDims(dp=2, tp=2, engine="fsdp")  # the (dp, cp) mesh cannot hold t
    with pytest.raises(ConfigError, match="does not divide"):
        _ = ParallelDims(dp=3, ep=2, engine="archon").expert_dp


def test_orders_per_engine():
    assert ParallelDims(engine="fsdp").rank_order == "cp-dp" == ParallelDims(engine="deepspeed").rank_order
    assert ParallelDims(engine="archon").rank_order == "tp-cp-ep-dp-pp"
    assert ParallelDims(pp=2, engine="megatron").rank_order == "tp-cp-ep-pp-dp"
    assert ParallelDims(dp=2, ep=2, engine="megatron").rank_order == "tp-cp-ep-pp-dp"
    assert ParallelDims(dp=2, pp=2, ep=2, engine="megatron").rank_order == MEGATRON_PP_LAST
    assert ParallelDims(engine="pkg.mod:Engine").rank_order == "tp-cp-ep-pp-dp"  # plugins: the default
    assert ParallelStrategy(dp=2, cp=2).dims("fsdp") == ParallelDims(dp=2, cp=2, engine="fsdp")
    assert ParallelStrategy(dp=2, ep=2, etp=1, tp=2).dims().expert_tp == 1
    assert ParallelStrategy(tp=2).dims().expert_tp == 2  # etp 0: the experts use tp


def test_coords_and_groups_follow_the_order():
    d = ParallelDims(dp=2, tp=2, pp=2, engine="archon")  # tp fastest, then dp, pp slowest
    assert d.mesh_shape() == (("pp", "dp", "cp", "tp"), (2, 2, 1, 2))
    assert d.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "etp": 1, "ep": 0, "edp": 0}
    assert d.group_ranks("tp", 5) == [4, 5]
    assert d.group_ranks("dp", 5) == [5, 7]
    assert d.group_ranks("pp", 5) == [1, 5]
    assert d.group_ranks("tp-pp", 5) == [0, 1, 4, 5]
    m = ParallelDims(dp=2, tp=2, pp=2, engine="megatron")  # pp before dp: a replica is contiguous
    assert m.group_ranks("tp-pp", 5) == [4, 5, 6, 7] and m.group_ranks("dp", 5) == [1, 5]
    for rank in range(m.world_size):
        c = m.coords(rank)
        assert rank == c["tp"] + 2 * (c["pp"] + 2 * c["dp"])
    with pytest.raises(ValueError, match="mixes"):
        m.group_ranks("tp-ep", 0)


# ---------------------------------------------------------------- plan == engine, per engine
def _fake_world(n: int):
    """Yield each rank of an n-rank world in turn under torch's in-process fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # left over by a failed test whose generator was never closed
        dist.destroy_process_group()
    for rank in range(n):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
        try:
            yield rank
        finally:
            dist.destroy_process_group()


def _mesh_ranks(mesh) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


@pytest.mark.parametrize("dp,cp", [(4, 1), (2, 2), (1, 4), (1, 1)])
@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_fsdp_mesh_matches(engine, dp, cp):
    pytest.importorskip("torch")
    import torch.distributed as dist

    from areal_cli.engines.parallelize import build_meshes

    parallel = ParallelStrategy(dp=dp, cp=cp)
    dims = parallel.dims(engine)
    for rank in _fake_world(dims.world_size):
        m = build_meshes(parallel, "cpu", engine)
        assert sorted(dist.get_process_group_ranks(m.dp_group)) == dims.group_ranks("dp", rank)
        assert sorted(dist.get_process_group_ranks(m.cp_group)) == dims.group_ranks("cp", rank)
        assert _mesh_ranks(m.fsdp_mesh) == dims.group_ranks("dp-cp", rank)
        assert (m.dp_rank, m.cp_rank) == (dims.coords(rank)["dp"], dims.coords(rank)["cp"])


ARCHON_LAYOUTS = [{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 2, "pp": 2}, {"dp": 2, "pp": 2, "ep": 2}, {"dp": 2, "cp": 2},
                  {"dp": 2, "cp": 2, "ep": 4}, {"dp": 2, "cp": 2, "tp": 2, "pp": 2}]


@pytest.mark.parametrize("sizes", ARCHON_LAYOUTS, ids=lambda s: "".join(f"{k}{v}" for k, v in s.items()))
def test_archon_mesh_matches(sizes):
    pytest.importorskip("torch")
    from areal_cli.engines.archon.mesh import ArchonDims

    dims = ArchonDims(**sizes)
    for rank in _fake_world(dims.world_size):
        m = dims.build("cpu")
        for dim in ("tp", "cp", "dp", "pp"):
            assert m.ranks(dim) == dims.group_ranks(dim, rank), dim
        assert m.ranks("dp_cp") == dims.group_ranks("dp-cp", rank)
        assert m.ranks("pp_cp_tp") == dims.group_ranks("tp-cp-pp", rank)
        c = dims.coords(rank)
        assert (m.pp_rank, m.dp_rank, m.cp_rank, m.tp_rank) == (c["pp"], c["dp"], c["cp"], c["tp"])
        if dims.ep > 1:  # experts: dp×cp unflattened into (efsdp, ep), ep innermost
            assert _mesh_ranks(m.ep_mesh) == dims.group_ranks("ep", rank)
            assert _mesh_ranks(m.efsdp_mesh) == dims.group_ranks("edp", rank)


def _megatron_layouts():
    for dp, tp, pp, ep, etp in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2, 4), (None, 1)):
        d = ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, engine="megatron")
        if d.world_size % (d.expert_tp * ep * pp) == 0:
            yield d


def test_megatron_groups_match_mcore():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps = pytest.importorskip("megatron.core.parallel_state")
    checked = 0
    for d in _megatron_layouts():
        order = ParallelStrategy(tp=d.tp, pp=d.pp, ep=d.ep).dims("megatron").rank_order  # the engine's line
        assert order == d.rank_order
        dense = ps.RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=1, order=order)
        expert = ps.RankGenerator(tp=d.expert_tp, ep=d.ep, dp=d.expert_dp, pp=d.pp, cp=1, order=order)
        if dense.get_ranks("pp") != expert.get_ranks("pp"):
            continue  # mcore's initialize_model_parallel refuses this layout itself
        for token in ("tp", "pp", "dp", "tp-pp", "dp-cp", "tp-dp-cp"):
            assert d.groups(token) == dense.get_ranks(token), (d, token)
        for ours, theirs in (("etp", "tp"), ("ep", "ep"), ("etp-ep", "tp-ep"), ("edp", "dp"),
                             ("etp-ep-pp", "tp-ep-pp")):
            assert d.groups(ours) == expert.get_ranks(theirs), (d, ours)
        checked += 1
    assert checked > 40


MEGATRON_LAYOUTS = [{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 2, "pp": 2}, {"dp": 2, "pp": 2, "ep": 2},
                    {"dp": 2, "tp": 2, "pp": 2, "ep": 2}, {"dp": 4, "tp": 2, "ep": 2, "etp": 1}]


@pytest.mark.parametrize("sizes", MEGATRON_LAYOUTS, ids=lambda s: "".join(f"{k}{v}" for k, v in s.items()))
def test_megatron_engine_groups_match(monkeypatch, sizes):
    """The engine's own ``_init_parallel_state`` builds mcore's real groups (under the fake process
    group; mcore's extra gloo groups are turned off, the fake store cannot back them)."""
    import functools

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mpu = pytest.importorskip("megatron.core.parallel_state")
        engine = pytest.importorskip("areal_cli.engines.megatron.engine")
    import torch.distributed as dist

    monkeypatch.setattr(mpu, "initialize_model_parallel",
                        functools.partial(mpu.initialize_model_parallel, create_gloo_process_groups=False))
    dims = ParallelDims(**sizes, engine="megatron")
    groups = {"tp": mpu.get_tensor_model_parallel_group, "pp": mpu.get_pipeline_model_parallel_group,
              "dp": mpu.get_data_parallel_group, "tp-pp": mpu.get_model_parallel_group,
              "ep": mpu.get_expert_model_parallel_group, "etp": mpu.get_expert_tensor_parallel_group,
              "edp": mpu.get_expert_data_parallel_group}
    for rank in _fake_world(dims.world_size):
        eng = engine.MegatronEngine.__new__(engine.MegatronEngine)
        try:
            eng._init_parallel_state(dims.tp, dims.pp, 1, dims.ep, dims.etp)
            for token, group in groups.items():
                assert sorted(dist.get_process_group_ranks(group())) == dims.group_ranks(token, rank), token
        finally:
            mpu.destroy_model_parallel()


def test_table_names_every_builtin_engine():
    from areal_cli.engines import BUILTIN_ENGINES

    assert set(RANK_ORDERS) == set(BUILTIN_ENGINES)
