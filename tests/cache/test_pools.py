from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.cache import PagePool


def test_fresh_pool_hands_out_ids_in_order_and_counts_them():
    pool = PagePool(4, "kv")
    assert pool.alloc(3) == [0, 1, 2]
    assert (pool.num_used, pool.num_free) == (3, 1)
    pool.free([1])
    assert pool.num_free == 2 and not pool.is_allocated(1) and pool.is_allocated(2)


def test_alloc_is_all_or_nothing():
    pool = PagePool(3)
    assert pool.alloc(2) is not None
    assert pool.alloc(2) is None
    assert pool.num_free == 1
    assert pool.alloc(0) == []


@pytest.mark.parametrize(
    "bad_free",
    [
        pytest.param([0, 0], id="duplicate"),
        pytest.param([7], id="foreign"),
        pytest.param([-1], id="negative"),
        pytest.param([2], id="already-free"),
    ],
)
def test_bad_free_raises_and_frees_nothing(bad_free):
    pool = PagePool(3)
    pool.alloc(2)
    with pytest.raises(ValueError):
        pool.free([1, *bad_free])
    assert pool.num_used == 2 and pool.is_allocated(1)


def test_double_free_raises():
    pool = PagePool(2)
    (page,) = pool.alloc(1)
    pool.free([page])
    with pytest.raises(ValueError, match="already free"):
        pool.free([page])


def test_negative_sizes_raise():
    with pytest.raises(ValueError):
        PagePool(-1)
    with pytest.raises(ValueError):
        PagePool(2).alloc(-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_random_alloc_free_matches_a_set_model(ops):
    pool = PagePool(8)
    held: set[int] = set()
    for is_alloc, n in ops:
        if is_alloc:
            ids = pool.alloc(n)
            assert (ids is None) == (n > 8 - len(held))
            if ids is not None:
                assert len(set(ids)) == n and not held & set(ids)
                held |= set(ids)
        elif held:
            victims = sorted(held)[:n]
            pool.free(victims)
            held -= set(victims)
        pool.check()
        assert pool.num_used == len(held) and pool.allocated_ids() == held
