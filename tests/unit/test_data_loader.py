"""StatefulDataLoader: epochs, shuffling, sharding and exact resume."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_cli.data.loader import StatefulDataLoader
from areal_cli.errors import DataError


def test_epoch_covers_every_item_once_and_shuffles_per_epoch():
    items = list(range(20))
    dl = StatefulDataLoader(items, 5, shuffle=True, seed=1)
    e0 = [x for b in dl for x in b]
    e1 = [x for b in dl for x in b]
    assert sorted(e0) == items and sorted(e1) == items
    assert e0 != e1 and e0 != items
    assert dl.epoch == 2 and len(dl) == 4


def test_drop_last_and_keep_last():
    items = list(range(11))
    assert [len(b) for b in StatefulDataLoader(items, 4, shuffle=False)] == [4, 4]
    assert [len(b) for b in StatefulDataLoader(items, 4, shuffle=False, drop_last=False)] == [4, 4, 3]


def test_next_batch_rolls_over_epochs():
    dl = StatefulDataLoader(list(range(6)), 4, shuffle=False)
    assert dl.next_batch() == [0, 1, 2, 3]
    assert dl.next_batch() == [0, 1, 2, 3]  # 4,5 dropped (drop_last), new epoch
    assert dl.epoch == 1


def test_shards_are_disjoint_and_equal():
    items = list(range(30))
    shards = [[x for b in StatefulDataLoader(items, 3, seed=4, rank=r, world_size=3) for x in b]
              for r in range(3)]
    assert all(len(s) == 9 for s in shards)
    flat = [x for s in shards for x in s]
    assert len(set(flat)) == len(flat)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 60), bs=st.integers(1, 8), cut=st.integers(0, 40), seed=st.integers(0, 99),
       single=st.booleans())
def test_resume_is_exact(n, bs, cut, seed, single):
    items = list(range(n))
    take = (lambda d: d.next_item()) if single else (lambda d: d.next_batch())
    ref = StatefulDataLoader(items, bs, seed=seed)
    expected = [take(ref) for _ in range(cut + 15)]
    a = StatefulDataLoader(items, bs, seed=seed)
    got = [take(a) for _ in range(cut)]
    state = json.loads(json.dumps(a.state_dict()))  # must survive a JSON round trip
    b = StatefulDataLoader(items, bs, seed=12345)  # seed comes from the state
    b.load_state_dict(state)
    got += [take(b) for _ in range(15)]
    assert got == expected


def test_resume_with_other_dataset_is_a_clear_error():
    a = StatefulDataLoader(list(range(10)), 2)
    a.next_batch()
    b = StatefulDataLoader(list(range(12)), 2)
    with pytest.raises(DataError, match="num_items"):
        b.load_state_dict(a.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError):
        StatefulDataLoader([1, 2], 4)
    with pytest.raises(ValueError):
        StatefulDataLoader([1, 2], 0)
    with pytest.raises(ValueError):
        StatefulDataLoader([1, 2, 3, 4], 1, rank=2, world_size=2)
