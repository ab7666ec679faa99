"""The hybrid prefix cache: shared KV blocks plus recurrent-state snapshots, on device and host.

Gated DeltaNet layers carry a recurrent state, so matched KV blocks alone cannot resume a
sequence: a cached prefix is usable only up to a position where a *snapshot* of the state (every
GDN layer's state and conv window, one runner slot) exists. A snapshot at position p names
tokens[0:p] by `chain` (the content hashes of its full 64-token blocks, `kv_blocks.chain_hash`)
and `tail` (the tokens of its partial last block). Resuming from it maps the chain's pages
(shared, read-only), gives the sequence a private copy of the tail's page (the sequence writes
its next positions there), and copies the state into the lane; prefill continues at p.

Where things live:
- full blocks: published device pages (`BlockManager`), demoted to host memory when the block
  manager evicts one that a snapshot still needs and the host budget has room;
- a snapshot's state: a device snapshot slot (the runner's slots beyond the lanes), or host
  memory once demoted; its tail page: always host memory (one page; a device copy would be a
  shared page the owner keeps writing, which the block rules forbid);
- a paused request's own resume point (preemption without recomputation) is a private snapshot
  only its owner matches; it is never evicted for cache entries.

Eviction is GDSF-like: an entry's priority is `clock + (1 + hits) * position / bytes` (prefill
tokens it saves per byte it holds, raised by hits), and `clock` rises to each evicted priority,
so old entries age out. Host memory goes first to dead blocks (no snapshot needs them), then
by priority; a snapshot whose blocks are gone is dropped with them. Pages in use are never
evicted (the block manager only evicts pages without users).

With a disk tier (`runtime.engine.disk_tier`, attached as `disk` by the engine side), a shared
snapshot evicted from memory is queued for disk with its blocks (`SpillSnapshot`), and `match`
also looks there: a deeper snapshot on disk is read into the host tier and matched from there.

All of this is bookkeeping: every copy is queued as a `cache_ops` record for the engine thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from runtime.engine.cache_ops import (CacheOp, CopySlot, HostCopy, LoadPages, LoadSlot, SavePages,
                                      SaveSlot, SpillSnapshot)
from runtime.engine.kv_blocks import BlockManager, block_hashes, chain_hash
from runtime.model.runner import PAGE_SIZE

if TYPE_CHECKING:
    from runtime.engine.disk_tier import DiskTier


@dataclass(frozen=True)
class PrefixCacheConfig:
    """reuse: match new prompts against cached prefixes (False: `--no-prefix-cache`; a paused
        request still keeps its own state and KV, so preemption needs no recomputation).
    snapshot_slots: runner slots (beyond the lanes) the cache may hold snapshots in.
    host_bytes: host memory for demoted snapshots, blocks and paused requests
        (`--host-context-mib`).
    slot_nbytes / page_nbytes: host bytes of one slot's state / one page (the runner's).
    """

    reuse: bool = True
    snapshot_slots: tuple[int, ...] = ()
    host_bytes: int = 0
    slot_nbytes: int = 0
    page_nbytes: int = 0


@dataclass(eq=False)
class Snapshot:
    """The state after tokens[0:position] of some sequence (see module docstring)."""

    name: str
    position: int
    chain: tuple[bytes, ...]
    tail: tuple[int, ...]
    owner: Optional[str] = None          # a paused request's private resume point
    slot: Optional[int] = None           # device snapshot slot holding the state
    state: Optional[HostCopy] = None     # or its host copy
    tail_copy: Optional[HostCopy] = None  # host copy of the tail's page (None: no tail)
    hits: int = 0
    priority: float = 0.0

    @property
    def anchor(self) -> Optional[bytes]:
        return self.chain[-1] if self.chain else None

    @property
    def host_nbytes(self) -> int:
        return (self.state.nbytes if self.state else 0) + (
            self.tail_copy.nbytes if self.tail_copy else 0)


def snapshot_key(chain: Sequence[bytes], tail: Sequence[int]) -> str:
    """The name of a shared snapshot: the chain hash of its tokens, tail included."""
    anchor = chain[-1] if chain else None
    return (chain_hash(anchor, tail) if tail else (anchor or chain_hash(None, ()))).hex()


class PrefixCache:
    """Snapshots, host copies and the matching rules over a `BlockManager`."""

    def __init__(self, config: PrefixCacheConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self._entries: dict[str, Snapshot] = {}
        self._by_anchor: dict[Optional[bytes], list[Snapshot]] = {}
        self._dependents: dict[bytes, set[str]] = {}      # block digest -> entry names
        self._host_blocks: dict[bytes, HostCopy] = {}
        self._free_slots = sorted(config.snapshot_slots, reverse=True)
        self._clock = 0.0
        self._pinned: Optional[Snapshot] = None    # the entry a resume is mapping right now
        self._ops: list[CacheOp] = []
        self.host_used = 0
        self.disk: Optional["DiskTier"] = None
        self.changes = 0       # entries added or dropped so far (the file tier saves on change)
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "snapshots": 0,
                      "snapshot_evictions": 0, "block_demotions": 0, "block_promotions": 0,
                      "pauses_saved": 0}
        blocks.is_live = lambda digest: digest in self._dependents
        blocks.on_evict = self._on_evict

    # --- queries ----------------------------------------------------------------------------

    def take_ops(self) -> list[CacheOp]:
        """The records queued since the last call, for the engine to apply in order."""
        ops, self._ops = self._ops, []
        return ops

    def entries(self) -> Iterable[Snapshot]:
        return self._entries.values()

    @property
    def device_snapshots(self) -> int:
        return sum(1 for e in self._entries.values() if e.slot is not None)

    def match(self, token_ids: Sequence[int], owner: str) -> Optional[Snapshot]:
        """The deepest usable snapshot for a sequence of these tokens: its own pause point, or
        (with reuse) a shared snapshot of a prefix. At least one token is always left to
        compute (its logits give the next token), so positions stop at len - 1."""
        limit = len(token_ids) - 1
        private = self._entries.get(f"pause:{owner}")
        if private is not None and private.position <= limit:
            return private                 # its owner's tokens only ever grow past it
        if not self.config.reuse:
            return None
        digests = block_hashes(token_ids[:limit])
        best = self._match_memory(token_ids, digests, limit)
        if self.disk is None:
            return best
        found = self.disk.match(token_ids, digests, limit, best.position if best else 0)
        while found is not None:
            data = self.disk.read(found, self._in_memory)
            if data is not None:
                state, tail_copy, blocks = data
                # A resume needs it now: it may push any cached entry out of the host tier
                # (lowest worth first; those go to disk in turn), never a pause point.
                if self.restore_entry(found.position, found.chain, found.tail, state, tail_copy,
                                      blocks, hits=found.hits, room_priority=math.inf):
                    self.disk.hit(found)
                    return self._entries[found.name]
                # No host room even so (pause points hold it); making room may have evicted
                # `best`: match again.
                return self._match_memory(token_ids, digests, limit)
            # Unreadable: it left the disk index (one warning); the next deepest on disk.
            found = self.disk.match(token_ids, digests, limit, best.position if best else 0)
        return best

    def _match_memory(self, token_ids: Sequence[int], digests: Sequence[bytes],
                      limit: int) -> Optional[Snapshot]:
        """The deepest shared snapshot in memory (device or host) of a prefix."""
        for depth in range(len(digests), -1, -1):
            anchor = digests[depth - 1] if depth else None
            start = depth * PAGE_SIZE
            best = None
            for entry in self._by_anchor.get(anchor, ()):
                if entry.owner is None and entry.position <= limit \
                        and tuple(token_ids[start:entry.position]) == entry.tail \
                        and (best is None or entry.position > best.position):
                    best = entry
            if best is not None:
                return best
        return None

    def resume_cost(self, entry: Snapshot) -> int:
        """Pages a resume from `entry` takes out of `blocks.num_free`: chain pages now cached
        (they gain a user), chain blocks only on the host and the tail (new pages)."""
        cost = 1 if entry.tail_copy is not None else 0
        for digest in entry.chain:
            page = self.blocks.lookup(digest)
            if page is None or not self.blocks.users(page):
                cost += 1
        return cost

    # --- resume, capture, pause -------------------------------------------------------------

    def resume(self, entry: Snapshot, owner: str, lane: int) -> list[int]:
        """Map `entry`'s blocks for `owner`, restore its state into `lane`; the page table of
        positions 0..position-1 (the caller checked `resume_cost` against the pool)."""
        # The entry and the host copies it needs are held first, and so are its device pages
        # (a page with a user is never evicted): the allocations below may evict other things.
        self._pinned = entry
        table: list[Optional[int]] = []
        promote: dict[int, HostCopy] = {}
        for index, digest in enumerate(entry.chain):
            page = self.blocks.lookup(digest)
            if page is not None:
                self.blocks.acquire(page, owner)
            else:
                promote[index] = self._host_blocks[digest]
            table.append(page)
        for index, copy in promote.items():
            page = self.blocks.allocate(1, owner)[0]
            self._ops.append(LoadPages(copy, (page,)))
            self.blocks.publish(page, entry.chain[index])
            self.stats["block_promotions"] += 1
            table[index] = page
        pages = [int(p) for p in table]
        if entry.tail_copy is not None:
            page = self.blocks.allocate(1, owner)[0]
            self._ops.append(LoadPages(entry.tail_copy, (page,)))
            pages.append(page)
        if entry.slot is not None:
            self._ops.append(CopySlot(entry.slot, lane))
        else:
            self._ops.append(LoadSlot(entry.state, lane))
        self._pinned = None
        if entry.owner is not None:
            self._drop(entry)                      # a pause point is used once
        else:
            entry.hits += 1
            entry.priority = self._priority(entry)
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += entry.position
        return pages

    def capture(self, token_ids: Sequence[int], position: int, digests: Sequence[bytes],
                page_table: Sequence[int], lane: int) -> bool:
        """Snapshot `lane` (its state is the one after tokens[0:position]) as a shared entry.
        False when it exists already, when `position` is not a multiple of the block size
        (only there does every cold run compute exactly this state: module docstring of
        `runtime.engine.sequence_cache`) or when there is no room worth taking."""
        chain, tail = tuple(digests[:position // PAGE_SIZE]), tuple(
            token_ids[position // PAGE_SIZE * PAGE_SIZE:position])
        name = snapshot_key(chain, tail)
        if name in self._entries or position < 1 or position % PAGE_SIZE:
            return False
        entry = Snapshot(name=name, position=position, chain=chain, tail=tail)
        entry.priority = self._priority(entry)
        tail_bytes = self.config.page_nbytes if tail else 0
        slot = self._take_slot(entry.priority)
        if not self._host_room(tail_bytes + (0 if slot is not None else self.config.slot_nbytes),
                               entry.priority):
            if slot is not None:
                self._free_slots.append(slot)
            return False
        if slot is None:
            entry.state = HostCopy(self.config.slot_nbytes)
            self._ops.append(SaveSlot(lane, entry.state))
        else:
            entry.slot = slot
            self._ops.append(CopySlot(lane, slot))
        if tail:
            entry.tail_copy = HostCopy(tail_bytes)
            self._ops.append(SavePages((page_table[position // PAGE_SIZE],), entry.tail_copy))
        self._add(entry)
        self.stats["snapshots"] += 1
        return True

    def pause(self, owner: str, token_ids: Sequence[int], position: int,
              digests: Sequence[bytes], page_table: Sequence[int], lane: int) -> bool:
        """Keep a paused request's state and partial block as its private resume point (its
        full blocks stay published and cached). False: no room, it must replay instead."""
        chain, tail = tuple(digests[:position // PAGE_SIZE]), tuple(
            token_ids[position // PAGE_SIZE * PAGE_SIZE:position])
        entry = Snapshot(name=f"pause:{owner}", position=position, chain=chain, tail=tail,
                         owner=owner, priority=math.inf)
        tail_bytes = self.config.page_nbytes if tail else 0
        use_slot = bool(self._free_slots)
        need = tail_bytes + (0 if use_slot else self.config.slot_nbytes)
        if not self._host_room(need, math.inf):
            return False
        if use_slot:
            entry.slot = self._free_slots.pop()
            self._ops.append(CopySlot(lane, entry.slot))
        else:
            entry.state = HostCopy(self.config.slot_nbytes)
            self._ops.append(SaveSlot(lane, entry.state))
        if tail:
            entry.tail_copy = HostCopy(tail_bytes)
            self._ops.append(SavePages((page_table[position // PAGE_SIZE],), entry.tail_copy))
        self._add(entry)
        self.stats["pauses_saved"] += 1
        return True

    def drop_private(self, owner: str) -> None:
        """A paused request ended (cancel) or will replay: its resume point goes."""
        entry = self._entries.get(f"pause:{owner}")
        if entry is not None:
            self._drop(entry)

    # --- the file tier (`runtime.engine.cache_file`) -----------------------------------------

    def shared_entries(self) -> list[Snapshot]:
        return [e for e in self._entries.values() if e.owner is None]

    def host_block(self, digest: bytes) -> Optional[HostCopy]:
        return self._host_blocks.get(digest)

    def restore_entry(self, position: int, chain: tuple[bytes, ...], tail: tuple[int, ...],
                      state: HostCopy, tail_copy: Optional[HostCopy],
                      blocks: dict[bytes, HostCopy], hits: int = 0,
                      room_priority: Optional[float] = None) -> bool:
        """Add a snapshot read from the file or the disk tier, state and blocks in host memory
        (blocks `blocks` lacks must be cached here: they are shared). False when the host
        budget has no room for it. room_priority: what it may evict for room (default: its
        own priority, i.e. entries worth less)."""
        name = snapshot_key(chain, tail)
        if name in self._entries:
            return False
        entry = Snapshot(name=name, position=position, chain=chain, tail=tail, state=state,
                         tail_copy=tail_copy, hits=hits)
        entry.priority = self._priority(entry)
        new_blocks = {d: c for d, c in blocks.items()
                      if d not in self._host_blocks and self.blocks.lookup(d) is None}
        need = entry.host_nbytes + sum(c.nbytes for c in new_blocks.values())
        # Pinned: the host blocks it shares are not dead while room is made for it.
        self._pinned = entry
        room = self._host_room(need, entry.priority if room_priority is None else room_priority)
        self._pinned = None
        if not room:
            return False
        for digest, copy in new_blocks.items():
            self._host_blocks[digest] = copy
            self.host_used += copy.nbytes
        self._add(entry)
        return True

    # --- internals --------------------------------------------------------------------------

    def _priority(self, entry: Snapshot) -> float:
        if entry.owner is not None:
            return math.inf
        size = self.config.slot_nbytes + (self.config.page_nbytes if entry.tail else 0)
        return self._clock + (1 + entry.hits) * entry.position / max(size, 1)

    def _in_memory(self, digest: bytes) -> bool:
        return self.blocks.lookup(digest) is not None or digest in self._host_blocks

    def _add(self, entry: Snapshot) -> None:
        self.changes += 1
        self._entries[entry.name] = entry
        self._by_anchor.setdefault(entry.anchor, []).append(entry)
        for digest in entry.chain:
            self._dependents.setdefault(digest, set()).add(entry.name)
        self.host_used += entry.host_nbytes

    def _drop(self, entry: Snapshot) -> None:
        self.changes += 1
        del self._entries[entry.name]
        siblings = self._by_anchor[entry.anchor]
        siblings.remove(entry)
        if not siblings:
            del self._by_anchor[entry.anchor]
        for digest in entry.chain:
            names = self._dependents[digest]
            names.discard(entry.name)
            if not names:
                del self._dependents[digest]
        if entry.slot is not None:
            self._free_slots.append(entry.slot)
        self.host_used -= entry.host_nbytes
        if entry.owner is None:
            self._clock = max(self._clock, entry.priority)

    def _evict_entry(self, entry: Snapshot, gone: Optional[tuple[bytes, int]] = None) -> None:
        """Evict an entry from memory (a shared one to the disk tier, if any). gone: (digest,
        page) of a chain block the block manager has just unpublished (its page is intact)."""
        if self.disk is not None and entry.owner is None:    # pause points never go to disk
            sources = []
            for digest in entry.chain:
                page = gone[1] if gone is not None and digest == gone[0] else \
                    self.blocks.lookup(digest)
                # Every block of an entry is on the device or the host (`check`).
                sources.append(page if page is not None else self._host_blocks[digest])
            self._ops.append(SpillSnapshot(entry.name, entry.position, entry.chain, entry.tail,
                                           entry.hits, entry.slot, entry.state, entry.tail_copy,
                                           tuple(sources)))
        self._drop(entry)
        self.stats["snapshot_evictions"] += 1

    def _take_slot(self, priority: float) -> Optional[int]:
        """A device snapshot slot for an entry of `priority`: a free one, or the slot of the
        lowest-priority shared entry below it (demoted to the host when there is room)."""
        if self._free_slots:
            return self._free_slots.pop()
        on_device = [e for e in self._entries.values() if e.slot is not None and e.owner is None]
        if not on_device:
            return None
        victim = min(on_device, key=lambda e: e.priority)
        if victim.priority > priority:
            return None
        slot = victim.slot
        if self._host_room(self.config.slot_nbytes, victim.priority, keep=victim):
            victim.state = HostCopy(self.config.slot_nbytes)
            self._ops.append(SaveSlot(slot, victim.state))
            victim.slot = None
            self.host_used += self.config.slot_nbytes
        else:
            self._evict_entry(victim)
            self._free_slots.remove(slot)
        return slot

    def _host_room(self, nbytes: int, priority: float, keep: Optional[Snapshot] = None) -> bool:
        """Make `nbytes` of host budget free for something of `priority`: dead host blocks go
        first, then shared entries of lower priority (never `keep`, never pause points)."""
        if nbytes > self.config.host_bytes:
            return False
        pinned = set(self._pinned.chain) if self._pinned is not None else set()
        while self.host_used + nbytes > self.config.host_bytes:
            dead = next((d for d in self._host_blocks
                         if d not in self._dependents and d not in pinned), None)
            if dead is not None:
                self.host_used -= self._host_blocks.pop(dead).nbytes
                continue
            holders = [e for e in self._entries.values()
                       if e.owner is None and e is not keep and e is not self._pinned
                       and e.priority < priority
                       and (e.host_nbytes or any(d in self._host_blocks for d in e.chain))]
            if not holders:
                return False
            self._evict_entry(min(holders, key=lambda e: e.priority))
        return True

    def _on_evict(self, page: int, digest: bytes) -> None:
        """The block manager takes a cached page for reuse: keep its K/V on the host if some
        snapshot needs it and there is room, else drop the snapshots that needed it."""
        names = self._dependents.get(digest)
        if not names:
            return
        priority = max(self._entries[n].priority for n in names)
        nbytes = self.config.page_nbytes
        if digest not in self._host_blocks and self._host_room(nbytes, priority):
            copy = HostCopy(nbytes)
            self._ops.append(SavePages((page,), copy))
            self._host_blocks[digest] = copy
            self.host_used += nbytes
            self.stats["block_demotions"] += 1
            return
        if digest in self._host_blocks:
            return
        for name in list(self._dependents.get(digest, ())):
            self._evict_entry(self._entries[name], gone=(digest, page))

    def check(self) -> None:
        """Every entry's blocks are on the device or the host; the host budget holds."""
        for entry in self._entries.values():
            for digest in entry.chain:
                assert self.blocks.lookup(digest) is not None or digest in self._host_blocks, \
                    f"{entry.name} lost block {digest.hex()}"
            assert (entry.slot is None) != (entry.state is None), entry.name
        used = sum(e.host_nbytes for e in self._entries.values()) + sum(
            c.nbytes for c in self._host_blocks.values())
        assert used == self.host_used <= self.config.host_bytes, (used, self.host_used)
        slots = [e.slot for e in self._entries.values() if e.slot is not None]
        assert len(slots) == len(set(slots)) and not set(slots) & set(self._free_slots)
        assert sorted(slots + self._free_slots) == sorted(self.config.snapshot_slots)
