"""Table-driven tests of the staleness capacity rule against a fake version provider."""

from __future__ import annotations

import pytest

from areal_cli.errors import ConfigError
from areal_cli.rollout.staleness import StalenessManager, VersionCounter


class FakeVersion:
    def __init__(self, v: int = 0):
        self.v = v

    def get_version(self) -> int:
        return self.v


def make(mc: int, k: int, bs: int, v: int = 0) -> tuple[StalenessManager, FakeVersion]:
    fv = FakeVersion(v)
    m = StalenessManager(max_concurrent=mc, max_head_offpolicyness=k, batch_size=bs, version_provider=fv)
    return m, fv


def drive(m: StalenessManager, accepted: int, running: int, rejected: int = 0) -> None:
    m.on_submit(accepted + running + rejected)
    if accepted:
        m.on_accept(accepted)
    if rejected:
        m.on_reject(rejected)


# (max_concurrent, k, batch, version, accepted, running, expected capacity)
CAPACITY_TABLE = [
    (64, 0, 4, 0, 0, 0, 4),      # synchronous: exactly one batch for version 0
    (64, 0, 4, 0, 3, 1, 0),      # the batch is fully admitted
    (64, 0, 4, 0, 4, 0, 0),      # accepted, not yet consumed, version not bumped
    (64, 0, 4, 1, 4, 0, 4),      # version bumped: next batch
    (64, 0, 4, 5, 20, 0, 4),
    (64, 1, 4, 0, 0, 0, 8),      # k=1: two batches ahead
    (64, 1, 4, 0, 5, 2, 1),
    (64, 2, 4, 3, 10, 3, 11),    # (2+3+1)*4 - 13
    (64, 4, 8, 0, 0, 0, 40),
    (6, 4, 8, 0, 0, 0, 6),       # concurrency binds
    (6, 4, 8, 0, 0, 6, 0),
    (6, 4, 8, 0, 30, 5, 1),      # min(6-5, 40-35)
    (10, 1, 4, 0, 8, 0, 0),      # staleness binds although nothing runs
    (64, 1, 4, 0, 9, 0, -1),     # restored counts above the bound: negative, nothing admitted
    (1, 0, 1, 0, 0, 0, 1),
]


@pytest.mark.parametrize("mc,k,bs,v,acc,run,expected", CAPACITY_TABLE)
def test_capacity_table(mc, k, bs, v, acc, run, expected):
    m, _ = make(mc, k, bs, v)
    drive(m, acc, run)
    assert m.get_capacity() == expected
    assert m.get_capacity(version=v) == expected


def test_capacity_follows_the_provider_version():
    m, fv = make(64, 1, 4)
    drive(m, accepted=8, running=0)
    seen = []
    for v in range(4):
        fv.v = v
        seen.append(m.get_capacity())
    assert seen == [0, 4, 8, 12]


# event scripts: (event, n) ... then expected (submitted, accepted, rejected, running, capacity)
EVENT_TABLE = [
    ([("submit", 4)], (4, 0, 0, 4, 0)),
    ([("submit", 4), ("reject", 2)], (4, 0, 2, 2, 2)),          # rejections free capacity
    ([("submit", 4), ("accept", 4)], (4, 4, 0, 0, 0)),
    ([("submit", 4), ("reject", 4), ("submit", 4), ("accept", 4)], (8, 4, 4, 0, 0)),
]


@pytest.mark.parametrize("events,expected", EVENT_TABLE)
def test_event_table_k0_batch4(events, expected):
    m, _ = make(64, 0, 4)
    for ev, n in events:
        getattr(m, f"on_{ev}")(n)
    s = m.stats
    assert (s.submitted, s.accepted, s.rejected, s.running, m.get_capacity()) == expected


@pytest.mark.parametrize("k", [0, 1, 3])
def test_synchronous_schedule_simulation(k):
    """Greedy admission + FIFO consumption: admitted-at version is never more than k behind the consumer."""
    bs = 3
    m, fv = make(100, k, bs)
    admitted_at: list[int] = []
    for step in range(6):
        fv.v = step
        cap = m.get_capacity()
        m.on_submit(cap)
        admitted_at += [step] * cap
        m.on_accept(cap)
        batch = admitted_at[step * bs:(step + 1) * bs]
        assert len(batch) == bs
        assert all(step - a <= k for a in batch)
        if k == 0:
            assert batch == [step] * bs


def test_state_dict_roundtrip_restores_accepted():
    m, fv = make(64, 1, 4, v=3)
    drive(m, accepted=12, running=0, rejected=5)
    state = m.state_dict()
    assert state == {"submitted": 17, "accepted": 12, "rejected": 5, "start_version": 0}
    m2, _ = make(64, 1, 4, v=3)
    m2.load_state_dict(state)
    assert m2.stats.accepted == 12 and m2.stats.running == 0
    assert m2.get_capacity() == m.get_capacity() == (1 + 3 + 1) * 4 - 12


def test_start_version_offsets_the_bound():
    """A manager that starts counting at version 5 behaves like a fresh one at version 0."""
    fv = FakeVersion(5)
    m = StalenessManager(64, 1, 4, fv, start_version=5)
    assert m.get_capacity() == 8
    drive(m, accepted=8, running=0)
    assert m.get_capacity() == 0
    fv.v = 6
    assert m.get_capacity() == 4
    m2 = StalenessManager(64, 1, 4, FakeVersion(6))
    m2.load_state_dict(m.state_dict())
    assert m2.start_version == 5 and m2.get_capacity() == 4


def test_load_state_refused_while_running():
    m, _ = make(64, 1, 4)
    m.on_submit(1)
    with pytest.raises(RuntimeError):
        m.load_state_dict({"accepted": 0})


def test_finishing_more_than_running_is_an_error():
    m, _ = make(64, 1, 4)
    m.on_submit(1)
    m.on_accept(1)
    with pytest.raises(RuntimeError):
        m.on_reject(1)


@pytest.mark.parametrize("kw,path", [
    ({"max_concurrent": 0}, "rollout.max_concurrent_rollouts"),
    ({"max_head_offpolicyness": -1}, "rollout.max_head_offpolicyness"),
    ({"batch_size": 0}, "algo.batch_size"),
    ({"batch_size": 2.5}, "algo.batch_size"),
])
def test_bad_config_is_typed(kw, path):
    args = {"max_concurrent": 4, "max_head_offpolicyness": 1, "batch_size": 2,
            "version_provider": VersionCounter()}
    args.update(kw)
    with pytest.raises(ConfigError) as ei:
        StalenessManager(**args)
    assert ei.value.path == path


def test_version_provider_must_have_get_version():
    with pytest.raises(TypeError):
        StalenessManager(4, 1, 2, version_provider=object())
