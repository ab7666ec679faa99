"""The KV block manager: reference-counted 64-token pages with content hashes.

The runner owns the page arrays; this class owns who may read and write each page id:

- Users. Every page has a set of users (the running sequences whose page tables hold it). A
  page with no user is either free or *cached*.
- Content hash. A page whose 64 positions are all computed can be published under the chain
  hash of its tokens (`chain_hash(previous block's hash, tokens)`), so the hash names the whole
  prefix up to the block's end, not just its own tokens. Another sequence with the same prefix
  then maps the same physical page (`acquire`) instead of computing it again.
- Cached pages. When its last user goes, a published page keeps its hash and becomes cached:
  still matchable, and also counted as available (`num_free`), because `allocate` evicts cached
  pages when the free list is empty. A page with users is never evicted.
- Writes. The engine computes a position only in a page whose sole user is the computing
  sequence (`writable`); a published page is never written again (all its rows are computed).

Eviction order among cached pages: pages no snapshot depends on first (`is_live` says which
hashes some snapshot still needs), then least recently released; a sequence releases its pages
tail first, so a prefix is evicted from its end. `on_evict` lets the prefix cache drop (or save
to the host) what depended on an evicted page.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from typing import Callable, Optional, Sequence

from runtime.engine.kv_pages import PoolExhausted, pages_for
from runtime.model.runner import PAGE_SIZE

__all__ = ["BlockManager", "PoolExhausted", "block_hashes", "chain_hash", "pages_for"]


def chain_hash(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """The content hash of a block (or a partial tail) given the hash of the blocks before it
    (None at the start of a sequence). blake2b over little-endian int32 ids: stable across
    processes and Python versions (the prefix-cache file stores these), unlike `hash()`."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else b"root")
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return digest.digest()


def decoded_hash(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """The hash a block holding decoded positions is published under: never equal to any
    prompt's `chain_hash` (token ids are never negative), so only the request that computed it
    (its pause point) can map it. Decode steps round differently from prefill, so another
    request mapping those K/V rows would not compute what its own cold run computes."""
    return chain_hash(parent, (*tokens, -1))


def media_key_ids(digest: str) -> tuple[int, int, int, int]:
    """Four negative ids from an image's content digest (hex, >= 128 bits): they stand for the
    image's pad tokens in the ids the prefix cache hashes (pad position p takes id p % 4), so
    prompts alike but for their pictures never share a block or a snapshot past the picture."""
    return tuple(-1 - (int(digest[8 * i:8 * i + 8], 16) & 0x7FFFFFFF) for i in range(4))


def block_hashes(token_ids: Sequence[int], parent: Optional[bytes] = None) -> list[bytes]:
    """Chain hashes of every full 64-token block of `token_ids` (a partial tail is left out)."""
    hashes = []
    for start in range(0, len(token_ids) - PAGE_SIZE + 1, PAGE_SIZE):
        parent = chain_hash(parent, token_ids[start:start + PAGE_SIZE])
        hashes.append(parent)
    return hashes


class BlockManager:
    """Page ids with users, content hashes and an evictable cache (see module docstring)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a KV block pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._users: dict[int, set[str]] = {}
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.is_live: Callable[[bytes], bool] = lambda digest: False
        self.on_evict: Callable[[int, bytes], None] = lambda page, digest: None
        self.evictions = 0

    # --- queries ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free ones plus cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._users)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, digest: bytes) -> Optional[int]:
        """The page published under `digest`, or None."""
        return self._page_of.get(digest)

    def hash_of(self, page: int) -> Optional[bytes]:
        return self._hash_of.get(page)

    def users(self, page: int) -> frozenset[str]:
        return frozenset(self._users.get(page, ()))

    def writable(self, page: int, owner: str) -> bool:
        """Whether `owner` may compute positions in `page`: its only user, never published."""
        return self._users.get(page) == {owner} and page not in self._hash_of

    def owners(self) -> dict[int, frozenset[str]]:
        """Page id -> users of every page in use (invariant checks)."""
        return {page: frozenset(users) for page, users in self._users.items()}

    # --- allocation and sharing -------------------------------------------------------------

    def allocate(self, count: int, owner: str) -> list[int]:
        """`count` private pages for `owner`, evicting cached pages when none is free."""
        if count < 0:
            raise ValueError(f"negative page count {count}")
        if count > self.num_free:
            raise PoolExhausted(f"{owner} asked for {count} pages, {self.num_free} available")
        pages = []
        for _ in range(count):
            page = self._free.pop() if self._free else self._evict_one()
            self._users[page] = {owner}
            pages.append(page)
        return pages

    def acquire(self, page: int, owner: str) -> None:
        """Add `owner` as a user of a published page (a matched prefix block), read-only."""
        if page not in self._hash_of:
            raise AssertionError(f"page {page} is not published; only published pages are shared")
        users = self._users.setdefault(page, set())
        if owner in users:
            raise AssertionError(f"{owner!r} already maps page {page}")
        users.add(owner)
        self._cached.pop(page, None)

    def release(self, pages: Sequence[int], owner: str) -> None:
        """Drop `owner` from each page, tail first: a page left without users is cached if it
        is published (most recently used last), else freed."""
        for page in reversed(pages):
            users = self._users.get(page)
            if users is None or owner not in users:
                raise AssertionError(f"page {page} released by {owner!r} but held by "
                                     f"{sorted(users or ())!r}")
            users.discard(owner)
            if users:
                continue
            del self._users[page]
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def publish(self, page: int, digest: bytes) -> int:
        """Publish a fully computed page under `digest`; returns the page now published under
        it. If another page already holds the same content (two sequences computed the same
        prefix at once), that one stays canonical and `page` stays private (freed on release)."""
        if page not in self._users:
            raise AssertionError(f"page {page} is published without a user")
        existing = self._page_of.get(digest)
        if existing is not None:
            return existing
        if page in self._hash_of:
            raise AssertionError(f"page {page} is already published")
        self._hash_of[page] = digest
        self._page_of[digest] = page
        return page

    # --- internals --------------------------------------------------------------------------

    def _evict_one(self) -> int:
        """Take a cached page for reuse: a dead one (no snapshot needs it) if any, else the
        least recently released."""
        victim = next((p for p in self._cached if not self.is_live(self._hash_of[p])), None)
        if victim is None:
            victim = next(iter(self._cached))
        digest = self._hash_of[victim]
        self._drop(victim)
        self.evictions += 1
        self.on_evict(victim, digest)
        return victim

    def _drop(self, page: int) -> None:
        """Unpublish a cached page (the caller frees or reuses it)."""
        del self._cached[page]
        digest = self._hash_of.pop(page)
        del self._page_of[digest]

    def check(self) -> None:
        """Every page is exactly one of: free, cached (published, no user), used."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice in the free list"
        cached = set(self._cached)
        used = set(self._users)
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert len(free) + len(cached) + len(used) == self.num_pages
        assert all(self._users[p] for p in used), "a used page has no user"
        assert all(p in self._hash_of for p in cached)
        assert all(self._page_of[d] == p for p, d in self._hash_of.items())
        assert not (free & set(self._hash_of)), "a free page kept its hash"
