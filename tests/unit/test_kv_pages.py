"""The state-slot lanes (allocation, ownership, exhaustion) and the page arithmetic."""

from __future__ import annotations

import pytest

from runtime.engine.kv_pages import PoolExhausted, StateSlots, pages_for


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
        StateSlots(0)


@pytest.mark.parametrize("tokens, pages", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2),
                                           (2048, 32), (2049, 33)])
def test_pages_for(tokens, pages):
    assert pages_for(tokens) == pages
