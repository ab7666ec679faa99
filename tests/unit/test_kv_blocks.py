"""The KV block manager: users per page, chained content hashes, the evictable cache, no leak."""

from __future__ import annotations

import random

import pytest

from runtime.engine.kv_blocks import BlockManager, block_hashes, chain_hash
from runtime.engine.kv_pages import PoolExhausted


def test_chain_hash_names_the_whole_prefix_and_is_stable():
    a = list(range(64))
    b = list(range(100, 164))
    # Same block after different prefixes: different hashes (the chain, not the block alone).
    assert chain_hash(chain_hash(None, a), b) != chain_hash(chain_hash(None, b), b)
    assert chain_hash(None, a) == chain_hash(None, tuple(a))
    assert len(chain_hash(None, a)) == 16
    assert block_hashes(a + b + [7] * 10) == [chain_hash(None, a),
                                              chain_hash(chain_hash(None, a), b)]
    assert block_hashes(a[:63]) == []


def test_chain_hash_is_blake2b_over_little_endian_int32():
    import hashlib
    import struct

    expected = hashlib.blake2b(b"root" + struct.pack("<3i", 5, 6, 70000), digest_size=16)
    assert chain_hash(None, [5, 6, 70000]) == expected.digest()


def test_two_users_share_a_published_page_and_it_is_freed_with_the_last():
    blocks = BlockManager(4)
    (page,) = blocks.allocate(1, "a")
    assert blocks.writable(page, "a")
    digest = chain_hash(None, range(64))
    assert blocks.publish(page, digest) == page
    assert not blocks.writable(page, "a")          # published: never written again
    blocks.acquire(page, "b")
    assert blocks.users(page) == {"a", "b"} and blocks.lookup(digest) == page
    blocks.release([page], "a")
    assert blocks.users(page) == {"b"} and blocks.num_free == 3
    blocks.release([page], "b")
    # No user left: cached (still matchable) and counted as available.
    assert blocks.num_cached == 1 and blocks.num_free == 4 and blocks.lookup(digest) == page
    blocks.check()


def test_unpublished_pages_are_freed_and_only_published_pages_are_shared():
    blocks = BlockManager(2)
    (page,) = blocks.allocate(1, "a")
    with pytest.raises(AssertionError, match="not published"):
        blocks.acquire(page, "b")
    blocks.release([page], "a")
    assert blocks.num_cached == 0 and blocks.num_free == 2


def test_a_second_page_with_the_same_content_stays_private():
    blocks = BlockManager(3)
    first, second = blocks.allocate(2, "a")
    digest = chain_hash(None, [9] * 64)
    assert blocks.publish(first, digest) == first
    assert blocks.publish(second, digest) == first          # canonical stays
    assert blocks.writable(second, "a") and blocks.hash_of(second) is None
    blocks.release([first, second], "a")
    assert blocks.num_cached == 1 and blocks.lookup(digest) == first


def test_eviction_takes_dead_pages_first_then_least_recent_and_never_used_ones():
    blocks = BlockManager(3)
    pages = blocks.allocate(3, "a")
    digests = [chain_hash(None, [i] * 64) for i in range(3)]
    for page, digest in zip(pages, digests):
        blocks.publish(page, digest)
    evicted = []
    blocks.on_evict = lambda page, digest: evicted.append(digest)
    blocks.is_live = lambda digest: digest == digests[2]       # a snapshot needs block 2
    blocks.release(pages[1:], "a")                             # tail first: 2 then 1 cached
    blocks.allocate(1, "b")
    assert evicted == [digests[1]]                             # dead before live
    blocks.allocate(1, "b")
    assert evicted == [digests[1], digests[2]]                 # then the live one
    with pytest.raises(PoolExhausted):
        blocks.allocate(1, "b")                                # page 0 is in use by "a"
    assert blocks.users(pages[0]) == {"a"} and blocks.evictions == 2
    blocks.check()


def test_release_by_a_stranger_or_twice_is_an_invariant_error():
    blocks = BlockManager(2)
    pages = blocks.allocate(1, "a")
    with pytest.raises(AssertionError):
        blocks.release(pages, "b")
    blocks.release(pages, "a")
    with pytest.raises(AssertionError):
        blocks.release(pages, "a")


@pytest.mark.parametrize("seed", range(5))
def test_random_sharing_leaks_nothing(seed):
    rng = random.Random(seed)
    blocks = BlockManager(16)
    held: dict[str, list[int]] = {}
    contents = [chain_hash(None, [i] * 64) for i in range(6)]
    for step in range(400):
        owner = f"r{rng.randrange(6)}"
        action = rng.random()
        if owner in held and action < 0.3:
            blocks.release(held.pop(owner), owner)
        elif owner not in held and blocks.num_free >= 2:
            table = []
            digest = rng.choice(contents)
            shared = blocks.lookup(digest)
            if shared is not None and action < 0.7:
                blocks.acquire(shared, owner)
                table.append(shared)
            else:
                (page,) = blocks.allocate(1, owner)
                table.append(page)
                blocks.publish(page, digest)                 # a duplicate stays private
            table += blocks.allocate(1, owner)
            held[owner] = table
        blocks.check()
        for name, table in held.items():
            assert all(name in blocks.users(p) for p in table)
    for name, table in held.items():
        blocks.release(table, name)
    assert blocks.num_used == 0 and blocks.num_free == 16
    blocks.check()
