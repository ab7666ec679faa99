"""Bookkeeping of the two device pools the engine hands out: KV pages and state slots.

The runner owns the storage (the page arrays and the recurrent-state slots); these classes only
track which ids are free and who holds them, so the scheduler can prove that nothing leaks.
Pages are 64 tokens (`runtime.model.runner.PAGE_SIZE`); a sequence of `n` computed tokens holds
`pages_for(n)` pages, listed in its page table in position order.
"""

from __future__ import annotations

from runtime.model.runner import PAGE_SIZE


def pages_for(num_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold `num_tokens` positions."""
    return -(-num_tokens // page_size) if num_tokens > 0 else 0


class PoolExhausted(Exception):
    """An allocation asked for more ids than are free (callers check `num_free` first)."""


class PagePool:
    """A free list of KV page ids with per-owner accounting.

    Allocation takes the lowest free ids first (a LIFO of freed pages would work as well; the
    order only matters for readable test failures). Each page remembers its owner so a double
    free or a free by the wrong owner is an invariant error, not silent corruption.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a KV page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, count: int, owner: str) -> list[int]:
        if count < 0:
            raise ValueError(f"negative page count {count}")
        if count > len(self._free):
            raise PoolExhausted(f"{owner} asked for {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._owner[page] = owner
        return pages

    def release(self, pages: list[int], owner: str) -> None:
        for page in pages:
            holder = self._owner.get(page)
            if holder != owner:
                raise AssertionError(f"page {page} released by {owner!r} but held by {holder!r}")
            del self._owner[page]
            self._free.append(page)

    def owners(self) -> dict[int, str]:
        """Page id -> owner of every allocated page (for invariant checks in tests)."""
        return dict(self._owner)


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
