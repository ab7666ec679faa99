"""The prefix cache's disk tier (`--ssd-context-gib N --ssd-context-dir DIR`): the shared
snapshots the host tier gives up, with the KV blocks they need, one file each in DIR.

- What goes to disk: a shared snapshot the host tier evicts (or that a full host tier cannot
  take from the device, or whose device block a full host tier cannot keep) is written with
  every block of its chain not on disk yet. Blocks alone are not worth a file (without a
  snapshot they resume nothing). Paused requests' private resume points never go to disk.
- Files: `snapshot-<name>.ixc` (the state, then the tail page) and `block-<digest>.ixc` (one
  page's K/V), named by content hash, so a block shared by many snapshots is written once.
  Each is `MAGIC`, a little-endian u32 header length, a JSON header (fingerprint, kind, name,
  the arrays' dtypes and shapes), the arrays' bytes, and a blake2b checksum of all before it;
  written to a temporary file in DIR and renamed, so a crash never leaves a partial file
  under a real name.
- Reading: when a prompt's deepest match is on disk, the snapshot and the blocks that are in
  neither the device pool nor the host tier are read, checked (checksum, fingerprint, name,
  sizes) and put in the host tier; the resume then goes as from the host tier. A missing or
  corrupt file is one warning and a miss (that snapshot, or every snapshot needing that block,
  leaves the index), never state from a wrong file.
- Cap: the files' bytes never exceed `cap_bytes`; room is made GDSF-style like the host tier
  (the snapshot of lowest `clock + (1 + hits) * position / bytes` goes first, with the blocks
  no other disk snapshot needs), and a snapshot worth less than everything there is not
  written.
- Write budget (`WriteBudget`): at most `write_bytes_per_hour` bytes in any trailing hour,
  because an SSD's endurance is counted in bytes written; a write beyond it is dropped (the
  snapshot is simply evicted, as without a disk tier). Deferring it would mean holding it in
  the RAM the host tier just gave up.
- Restarts: this run's index is in memory only, so the `.ixc` files found in DIR at start
  (an earlier run's, whatever its fingerprint) are removed; no other file in DIR is touched.

Writes and reads run on the engine thread (writes where the `SpillSnapshot` record sits in the
cache's queue, reads while matching), so a step waits for them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Collection, Optional, Sequence

import numpy as np

from runtime.engine.cache_ops import HostCopy, SpillSnapshot
from runtime.model.runner import PAGE_SIZE, HostArrays, ModelRunner

MAGIC = b"IXSSD1\n"
SUFFIX = ".ixc"
CHECKSUM_BYTES = 32
HOUR = 3600.0


@dataclass(frozen=True)
class DiskTierConfig:
    """directory / cap_bytes: `--ssd-context-dir` / `--ssd-context-gib`;
    write_bytes_per_hour: `--ssd-context-gib-per-hour`; fingerprint: what the arrays depend
    on (`cache_fingerprint`); slot_nbytes / page_nbytes: the runner's sizes (checked on read)."""

    directory: str
    cap_bytes: int
    write_bytes_per_hour: int
    fingerprint: str
    slot_nbytes: int
    page_nbytes: int


@dataclass(eq=False)
class DiskSnapshot:
    """A snapshot on disk; its blocks are `DiskTier` block files."""

    name: str
    position: int
    chain: tuple[bytes, ...]
    tail: tuple[int, ...]
    nbytes: int                 # its own file's size
    hits: int = 0
    priority: float = 0.0


class WriteBudget:
    """At most `per_hour` bytes written in any trailing hour. `clock`: seconds, monotonic."""

    def __init__(self, per_hour: int, clock: Callable[[], float] = time.monotonic):
        self.per_hour = per_hour
        self.clock = clock
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.used = 0                              # bytes written in the trailing hour

    def allows(self, nbytes: int) -> bool:
        """Whether a write of `nbytes` now keeps the trailing hour within the budget."""
        now = self.clock()
        while self._recent and self._recent[0][0] <= now - HOUR:
            self.used -= self._recent.popleft()[1]
        return self.used + nbytes <= self.per_hour

    def take(self, nbytes: int) -> None:
        """Count a write of `nbytes` (after `allows` said yes)."""
        self._recent.append((self.clock(), nbytes))
        self.used += nbytes


class _Unreadable(Exception):
    """A disk file that cannot be used; `block` names the block file (None: the snapshot's)."""

    def __init__(self, message: str, block: Optional[bytes]):
        super().__init__(message)
        self.block = block


class DiskTier:
    """The files in DIR and their in-memory index (see module docstring)."""

    def __init__(self, config: DiskTierConfig, warn: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._warn = warn
        self.budget = WriteBudget(config.write_bytes_per_hour, clock)
        self._snapshots: dict[str, DiskSnapshot] = {}
        self._by_anchor: dict[Optional[bytes], list[DiskSnapshot]] = {}
        self._blocks: dict[bytes, int] = {}                 # digest -> file bytes
        self._block_users: dict[bytes, set[str]] = {}       # digest -> disk snapshot names
        self._clock = 0.0
        self.used = 0
        self.stats = {"ssd_bytes_written": 0, "ssd_bytes_read": 0, "ssd_hits": 0,
                      "ssd_read_failures": 0, "ssd_writes_dropped": 0, "ssd_evictions": 0}
        self.removed_at_start = 0
        for name in os.listdir(config.directory):
            if name.endswith(SUFFIX):
                os.unlink(os.path.join(config.directory, name))
                self.removed_at_start += 1

    # --- matching and reading ---------------------------------------------------------------

    def match(self, token_ids: Sequence[int], digests: Sequence[bytes], limit: int,
              deeper_than: int) -> Optional[DiskSnapshot]:
        """The deepest disk snapshot of a prefix of `token_ids` (its block `digests`) ending
        after `deeper_than` and at most at `limit` (the rules of `PrefixCache.match`)."""
        for depth in range(len(digests), -1, -1):
            if depth * PAGE_SIZE + PAGE_SIZE - 1 <= deeper_than:
                return None                # nothing at this depth or above ends deeper
            start = depth * PAGE_SIZE
            found = [s for s in self._by_anchor.get(digests[depth - 1] if depth else None, ())
                     if deeper_than < s.position <= limit
                     and tuple(token_ids[start:s.position]) == s.tail]
            if found:
                return max(found, key=lambda s: s.position)
        return None

    def read(self, item: DiskSnapshot, in_memory: Callable[[bytes], bool]
             ) -> Optional[tuple[HostCopy, Optional[HostCopy], dict[bytes, HostCopy]]]:
        """`item`'s state, tail page and the blocks of its chain not `in_memory`, checked; None
        (one warning, the unusable files leave the index) when a file is missing or bad."""
        try:
            parts, state_parts = self._read(self._snapshot_path(item.name), "snapshot",
                                            item.name, None)
            state, tail = parts[:state_parts], parts[state_parts:]
            _expect(state, self.config.slot_nbytes, "state", None)
            if item.tail:
                _expect(tail, self.config.page_nbytes, "tail page", None)
            blocks = {}
            for digest in item.chain:
                if not in_memory(digest):
                    data, _ = self._read(self._block_path(digest), "block", digest.hex(), digest)
                    _expect(data, self.config.page_nbytes, "block", digest)
                    blocks[digest] = HostCopy.of(data)
        except _Unreadable as exc:
            self.stats["ssd_read_failures"] += 1
            self._warn(f"prefix cache disk tier: {exc}; that prefix is recomputed")
            if exc.block is None:
                self._drop(item)
            else:
                for name in list(self._block_users.get(exc.block, ())):
                    self._drop(self._snapshots[name])
            return None
        return HostCopy.of(state), (HostCopy.of(tail) if item.tail else None), blocks

    def hit(self, item: DiskSnapshot) -> None:
        """`item` was read back into the host tier: it counts as a hit, here and in GDSF."""
        item.hits += 1
        item.priority = self._priority(item)
        self.stats["ssd_hits"] += 1

    # --- writing (the `SpillSnapshot` record, applied in queue order) -----------------------

    def spill(self, runner: ModelRunner, op: SpillSnapshot) -> int:
        """Write `op`'s snapshot and the blocks of its chain not on disk yet, within the cap
        and the write budget; returns the bytes read from the device."""
        known = self._snapshots.get(op.name)
        if known is not None:                  # written before: no second write (SSD wear)
            known.hits = max(known.hits, op.hits)
            known.priority = self._priority(known)
            return 0
        new = [i for i, digest in enumerate(op.chain) if digest not in self._blocks]
        device = 0
        if op.slot is not None:
            state = runner.save_slot(op.slot).wait()
            device += self.config.slot_nbytes
        else:
            state = op.state.data.wait()
        files = []
        for i in new:
            source = op.blocks[i]
            if isinstance(source, HostCopy):
                data = source.data.wait()
            else:
                data = runner.read_pages([source]).wait()
                device += self.config.page_nbytes
            files.append((op.chain[i], self._encode("block", op.chain[i].hex(), data, 0)))
        tail = op.tail_copy.data.wait() if op.tail_copy is not None else ()
        snapshot = self._encode("snapshot", op.name, tuple(state) + tuple(tail), len(state))
        total = len(snapshot) + sum(len(data) for _, data in files)
        item = DiskSnapshot(name=op.name, position=op.position, chain=op.chain, tail=op.tail,
                            nbytes=len(snapshot), hits=op.hits)
        item.priority = self._priority(item)
        # The budget is asked first: room is made only for a write that will happen.
        if not self.budget.allows(total) or not self._room(total, item.priority, set(op.chain)):
            self.stats["ssd_writes_dropped"] += 1
            self._drop_orphans(op.chain)
            return device
        self.budget.take(total)
        try:
            for digest, data in files:
                _write(self._block_path(digest), data)
                self._blocks[digest] = len(data)
                self.used += len(data)
            _write(self._snapshot_path(op.name), snapshot)
        except OSError as exc:
            self._warn(f"prefix cache disk tier: a write to {self.config.directory} failed "
                       f"({exc}); that snapshot is dropped")
            self._drop_orphans(op.chain)
            return device
        self.used += len(snapshot)
        self.stats["ssd_bytes_written"] += total
        self._snapshots[item.name] = item
        self._by_anchor.setdefault(item.chain[-1] if item.chain else None, []).append(item)
        for digest in item.chain:
            self._block_users.setdefault(digest, set()).add(item.name)
        return device

    # --- internals --------------------------------------------------------------------------

    def _priority(self, item: DiskSnapshot) -> float:
        return self._clock + (1 + item.hits) * item.position / max(item.nbytes, 1)

    def _room(self, nbytes: int, priority: float, keep: set[bytes]) -> bool:
        """Make `nbytes` free under the cap, evicting snapshots of lower priority (their blocks
        in `keep`, the new snapshot's chain, stay)."""
        if nbytes > self.config.cap_bytes:
            return False
        while self.used + nbytes > self.config.cap_bytes:
            victims = [s for s in self._snapshots.values() if s.priority < priority]
            if not victims:
                return False
            victim = min(victims, key=lambda s: s.priority)
            self._clock = max(self._clock, victim.priority)
            self._drop(victim, keep)
            self.stats["ssd_evictions"] += 1
        return True

    def _drop(self, item: DiskSnapshot, keep: Collection[bytes] = ()) -> None:
        """Forget `item` and delete its file and the block files no other snapshot needs."""
        del self._snapshots[item.name]
        siblings = self._by_anchor[item.chain[-1] if item.chain else None]
        siblings.remove(item)
        if not siblings:
            del self._by_anchor[item.chain[-1] if item.chain else None]
        self._delete(self._snapshot_path(item.name))
        self.used -= item.nbytes
        for digest in item.chain:
            users = self._block_users[digest]
            users.discard(item.name)
            if not users:
                del self._block_users[digest]
                if digest not in keep:
                    self._delete_block(digest)

    def _drop_orphans(self, chain: Sequence[bytes]) -> None:
        """Delete the blocks of `chain` on disk that no snapshot needs (a spill that failed)."""
        for digest in chain:
            if digest in self._blocks and digest not in self._block_users:
                self._delete_block(digest)

    def _delete_block(self, digest: bytes) -> None:
        self.used -= self._blocks.pop(digest)
        self._delete(self._block_path(digest))

    @staticmethod
    def _delete(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:                   # removed by hand: nothing left to delete
            pass

    def _snapshot_path(self, name: str) -> str:
        return os.path.join(self.config.directory, f"snapshot-{name}{SUFFIX}")

    def _block_path(self, digest: bytes) -> str:
        return os.path.join(self.config.directory, f"block-{digest.hex()}{SUFFIX}")

    def _encode(self, kind: str, name: str, parts: HostArrays, state_parts: int) -> bytes:
        header = json.dumps({"fingerprint": self.config.fingerprint, "kind": kind,
                             "name": name, "state_parts": state_parts,
                             "arrays": [[p.dtype.str, list(p.shape)] for p in parts]}).encode()
        payload = b"".join([MAGIC, struct.pack("<I", len(header)), header,
                            *(np.ascontiguousarray(p).tobytes() for p in parts)])
        return payload + hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).digest()

    def _read(self, path: str, kind: str, name: str, block: Optional[bytes]
              ) -> tuple[HostArrays, int]:
        """The arrays of a file (and its header's state_parts), every check passed."""
        try:
            with open(path, "rb") as handle:
                data = bytearray(os.fstat(handle.fileno()).st_size)
                handle.readinto(data)
        except OSError as exc:
            raise _Unreadable(f"{path} unreadable ({exc})", block) from exc
        self.stats["ssd_bytes_read"] += len(data)
        payload = memoryview(data)[:-CHECKSUM_BYTES]
        if len(data) < len(MAGIC) + 4 + CHECKSUM_BYTES or not data.startswith(MAGIC) or \
                hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).digest() \
                != bytes(data[-CHECKSUM_BYTES:]):
            raise _Unreadable(f"{path} is corrupt (checksum)", block)
        (length,) = struct.unpack_from("<I", data, len(MAGIC))
        offset = len(MAGIC) + 4 + length
        header = json.loads(bytes(data[len(MAGIC) + 4:offset]).decode())
        if (header["fingerprint"], header["kind"], header["name"]) != \
                (self.config.fingerprint, kind, name):
            raise _Unreadable(f"{path} belongs to another {kind} or server", block)
        parts = []
        for dtype, shape in header["arrays"]:
            array = np.frombuffer(data, dtype=np.dtype(dtype), count=int(np.prod(shape)),
                                  offset=offset).reshape(shape)
            offset += array.nbytes
            parts.append(array)
        if offset != len(payload):
            raise _Unreadable(f"{path} does not hold what its header says", block)
        return tuple(parts), int(header["state_parts"])

    def check(self) -> None:
        """The index matches DIR's files and the cap holds; every snapshot has its blocks."""
        sizes = {e.name: e.stat().st_size for e in os.scandir(self.config.directory)
                 if e.name.endswith(SUFFIX)}
        expected = {os.path.basename(self._snapshot_path(s.name)): s.nbytes
                    for s in self._snapshots.values()}
        expected.update({os.path.basename(self._block_path(d)): n for d, n in self._blocks.items()})
        assert sizes == expected, (sizes, expected)
        assert self.used == sum(sizes.values()) <= self.config.cap_bytes
        for item in self._snapshots.values():
            assert all(d in self._blocks for d in item.chain), item.name
        assert set(self._block_users) == set(self._blocks)


def _expect(parts: HostArrays, nbytes: int, what: str, block: Optional[bytes]) -> None:
    if sum(p.nbytes for p in parts) != nbytes:
        raise _Unreadable(f"a disk {what} of {sum(p.nbytes for p in parts)} bytes, this runner's "
                          f"is {nbytes}", block)


def _write(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically: a temporary file in the same directory, renamed."""
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX,
                                         dir=os.path.dirname(path))
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
