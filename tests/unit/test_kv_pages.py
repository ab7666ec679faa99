"""The KV page pool and the state-slot lanes: allocation, ownership, exhaustion."""

from __future__ import annotations

import pytest

from runtime.engine.kv_pages import PagePool, PoolExhausted, StateSlots, pages_for


def test_pages_are_handed_out_lowest_first_and_returned():
    pool = PagePool(4)
    assert pool.allocate(2, "a") == [0, 1]
    assert pool.allocate(1, "b") == [2]
    assert pool.num_free == 1 and pool.num_used == 3
    pool.release([0, 1], "a")
    assert pool.num_free == 3
    assert pool.owners() == {2: "b"}


def test_exhaustion_and_wrong_owner():
    pool = PagePool(2)
    pool.allocate(2, "a")
    with pytest.raises(PoolExhausted):
        pool.allocate(1, "b")
    with pytest.raises(AssertionError):
        pool.release([0], "b")
    pool.release([0, 1], "a")
    with pytest.raises(AssertionError):          # double free
        pool.release([0], "a")


def test_slots():
    slots = StateSlots(2)
    assert slots.acquire("a") == 0 and slots.acquire("b") == 1
    with pytest.raises(PoolExhausted):
        slots.acquire("c")
    slots.release(0, "a")
    assert slots.acquire("c") == 0
    with pytest.raises(AssertionError):
        slots.release(1, "a")


def test_invalid_sizes():
    with pytest.raises(ValueError):
        PagePool(0)
    with pytest.raises(ValueError):
        StateSlots(0)


@pytest.mark.parametrize("tokens, pages", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2),
                                           (2048, 32), (2049, 33)])
def test_pages_for(tokens, pages):
    assert pages_for(tokens) == pages
