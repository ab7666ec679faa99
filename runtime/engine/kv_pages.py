"""Bookkeeping of the lanes (state slots) and the page arithmetic the engine shares.

The runner owns the storage (the page arrays and the recurrent-state slots); `StateSlots` only
tracks which lane ids are free and who holds them, so the scheduler can prove that nothing
leaks. KV pages are handed out by `runtime.engine.kv_blocks.BlockManager` (shared, hashed
pages). Pages are 64 tokens (`runtime.model.runner.PAGE_SIZE`); a sequence of `n` computed
tokens holds `pages_for(n)` pages, listed in its page table in position order.
"""

from __future__ import annotations

from runtime.model.runner import PAGE_SIZE


def pages_for(num_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold `num_tokens` positions."""
    return -(-num_tokens // page_size) if num_tokens > 0 else 0


class PoolExhausted(Exception):
    """An allocation asked for more pages or slots than are available (callers check first)."""


class StateSlots:
    """The lanes: one recurrent-state slot per running sequence, fixed at startup (1..8)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, owner: str) -> int:
        if not self._free:
            raise PoolExhausted(f"{owner} asked for a state slot, none free")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def release(self, slot: int, owner: str) -> None:
        holder = self._owner.get(slot)
        if holder != owner:
            raise AssertionError(f"slot {slot} released by {owner!r} but held by {holder!r}")
        del self._owner[slot]
        self._free.append(slot)
        # Keep handing out the lowest slot first so lane numbering stays stable in logs.
        self._free.sort(reverse=True)

    def owners(self) -> dict[int, str]:
        return dict(self._owner)
