"""The prefix cache's file tier (`--prefix-cache-file`): shared snapshots and the KV blocks
they need, kept across restarts.

Format 2. Format 1 was an `.npz` archive with one member per block part, each block read
from the device on its own and waited for (1,809 of them for a 115K-token conversation at the
27B shape, ~7.4 GB, zipped with a CRC pass): the H200's save did not finish within the 30 s a
supervisor gave the stopping server. All integers little-endian:

- bytes 0..11: `MAGIC` and the u32 format version; zeros up to `DATA_START`.
- the data section, `DATA_START` up to the manifest: a few large arrays, each at a 64-byte
  aligned offset. `page{j}`: part j of every page the file holds (the blocks in chain order,
  then the snapshots' tail pages), exactly what one `read_pages` of all of them would return
  (the page axis is axis 1: `runtime.model.runner.ModelRunner.read_pages`). `state{j}`: part
  j of every snapshot's state, stacked on a new axis 0.
- the manifest: UTF-8 JSON (fingerprint, snapshot records, block digests, the arrays' dtypes,
  shapes and offsets, and one CRC-32 per `CHUNK` bytes of the data section).
- the footer (`FOOTER`): the manifest's offset, length and CRC-32, then `END`.

The fingerprint names everything the arrays depend on (model, artifact, runner build and
dtype, KV format, state and page sizes). A file of another version or fingerprint, a
truncated one (sizes, footer) or a corrupt one (checksums) is ignored with one warning that
says why, and replaced at the next save. Writes go to a temporary file in the same directory,
then `os.replace`, so a crash mid-write leaves the old file intact (no fsync: after a power
loss the checksums catch a half-written file, and a cache may be lost); a kill mid-write leaves
the temporary, which the next start removes (`remove_stale_temporaries`).

A save has two halves. `gather_cache_file`, on the engine thread, copies what the file needs
to the host at one instant: device pages in runs of up to `RUN_PAGES` (one copy per layer
part per run of consecutive page ids: `runtime.model.gpu.runner`) and device snapshot slots,
all started before the first is waited for, plus references to the host tier's copies and the
manifest's records; a budget bounds the copies (deepest snapshots kept first).
`write_cache_file`, on any thread, writes and checksums only what it was handed, so the cache
may change meanwhile (`runtime.engine.engine_cache` runs it on a writer thread). Reading fills
one buffer with the whole data section, its chunks read and checksummed on a thread pool;
every page and state the host tier gets is a view into it. Everything is read and checked
before anything enters the cache, into the host tier (as far as `--host-context-mib` allows,
deepest snapshots first); the read runs in the engine's constructor.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from runtime.engine.cache_ops import HostCopy
from runtime.engine.prefix_cache import PrefixCache, Snapshot
from runtime.model.runner import HostArrays, HostReady, ModelRunner

FORMAT_VERSION = 2
MAGIC = b"IXPCF\x00\r\n"
VERSION = struct.Struct("<I")
END = b"IXPCFEND"
FOOTER = struct.Struct("<QQI4x8s")        # manifest offset, length, its CRC-32, END
DATA_START = 4096
ALIGN = 64
# CRC-32 (zlib) per 64 MiB: of zlib.crc32 / adler32 / blake2b / sha256 over 256 MiB on the
# 2-core dev VM (2026-12-02, zlib 1.2.13), 1.8 / 1.35 / 0.67 / 1.1 GB/s on one thread, and
# crc32 drops the GIL (2.8 GB/s on two threads), so chunks are checked in parallel. It catches
# any burst error up to 32 bits and all but 2**-32 of other corruption; the file is as trusted
# as the server's own directory, so a cryptographic hash would buy nothing.
CHUNK = 64 << 20
RUN_PAGES = 64                            # 256 MiB a device read at the 27B shape (4 MiB/page)
THREADS = min(8, os.cpu_count() or 1)


class _Unusable(Exception):
    """A file that cannot be used; the message says why (the warning's text)."""


# --- saving ---------------------------------------------------------------------------------

@dataclass
class Gathered:
    """Everything one save writes, taken at one instant and owned by the save: the manifest's
    parts and host arrays no one writes to (the save's own copies of device pages and slots,
    and the host tier's copies, which are never written in place: an eviction only lets go of
    them, and these references keep them alive until the file is written). Every device copy
    has completed: the writer thread makes no runner (CUDA) call.

    states: each record's state, in record order. pages: (file index of the first page, the
    pages' arrays, page axis 1), covering file pages 0..page_count-1 in order. copied_bytes:
    the host memory of the save's own copies (`budget` bounds it). skipped: snapshots left
    out for the budget."""

    fingerprint: str
    records: list[dict]
    blocks: list[bytes]
    states: list[HostArrays]
    pages: list[tuple[int, HostArrays]]
    page_count: int
    copied_bytes: int
    skipped: int


def save_cache_file(path: str, fingerprint: str, cache: PrefixCache, runner: ModelRunner) -> int:
    """Write every shared snapshot and its blocks in one call; returns the bytes written."""
    return write_cache_file(path, gather_cache_file(fingerprint, cache, runner))


def gather_cache_file(fingerprint: str, cache: PrefixCache, runner: ModelRunner,
                      budget: Optional[int] = None) -> Gathered:
    """The first half of a save, on the engine thread: copy what the file needs to the host and
    wait for the copies (device pages in runs of up to `RUN_PAGES` consecutive ones). budget:
    the most host memory these copies may take; the snapshots that do not fit are left out,
    deepest kept first (as a load fills the host tier)."""
    entries = cache.shared_entries()
    kept = entries if budget is None else _within(budget, entries, cache, runner)
    blocks: dict[bytes, int] = {}                    # digest -> page index in the file
    for entry in kept:
        for digest in entry.chain:
            blocks.setdefault(digest, len(blocks))
    # A page's source: its device page id, or its host copy (blocks demoted, tails).
    sources: list[Union[int, HostCopy]] = [
        page if (page := cache.blocks.lookup(d)) is not None else cache.host_block(d)
        for d in blocks]
    records = []
    for entry in kept:
        tail_page = None
        if entry.tail_copy is not None:
            tail_page = len(sources)
            sources.append(entry.tail_copy)
        records.append({"position": entry.position, "hits": entry.hits,
                        "chain": [blocks[d] for d in entry.chain], "tail": list(entry.tail),
                        "tail_page": tail_page})
    # Every copy is started before the first is waited for: the device copies them back to back.
    states = [runner.save_slot(e.slot) if e.slot is not None else e.state.data for e in kept]
    pages = [(first, runner.read_pages(source) if isinstance(source, list) else source.data)
             for first, source in _runs(sources)]
    copied = runner.slot_nbytes * sum(e.slot is not None for e in kept) \
        + runner.page_nbytes * sum(not isinstance(s, HostCopy) for s in sources)
    return Gathered(fingerprint, records, list(blocks), [t.wait() for t in states],
                    [(first, t.wait()) for first, t in pages], len(sources), copied,
                    len(entries) - len(kept))


def _within(budget: int, entries: list[Snapshot], cache: PrefixCache,
            runner: ModelRunner) -> list[Snapshot]:
    """The entries whose device copies fit in `budget` bytes, deepest taken first (a block
    two of them share counts once), in their original order."""
    counted: set[bytes] = set()
    chosen: set[str] = set()
    used = 0
    for entry in sorted(entries, key=lambda e: -e.position):
        new = {d for d in entry.chain if d not in counted and cache.blocks.lookup(d) is not None}
        need = len(new) * runner.page_nbytes + (runner.slot_nbytes if entry.slot is not None else 0)
        if used + need <= budget:
            used += need
            counted |= new
            chosen.add(entry.name)
    return [e for e in entries if e.name in chosen]


def _runs(sources: list[Union[int, HostCopy]]) -> list[tuple[int, Union[list[int], HostCopy]]]:
    """(first file index, source) per host copy and per run of up to `RUN_PAGES` device pages
    that follow each other in the file."""
    groups: list[tuple[int, Union[list[int], HostCopy]]] = []
    for index, source in enumerate(sources):
        if isinstance(source, HostCopy):
            groups.append((index, source))
        elif groups and isinstance(groups[-1][1], list) and len(groups[-1][1]) < RUN_PAGES:
            groups[-1][1].append(source)
        else:
            groups.append((index, [source]))
    return groups


def write_cache_file(path: str, gathered: Gathered) -> int:
    """The second half of a save, on any thread (it reads only `gathered`): write the file to a
    temporary next to `path`, checksum it, and rename it over `path`; returns its size."""
    handle, temporary = _new_temporary(path)
    try:
        with os.fdopen(handle, "r+b") as out:
            writer = _Writer(out.fileno())
            for i, state in enumerate(gathered.states):
                writer.put("state", tuple(part[np.newaxis] for part in state), 0, i,
                           len(gathered.states))
            for first, data in gathered.pages:
                writer.put("page", data, 1, first, gathered.page_count)
            manifest = {"fingerprint": gathered.fingerprint, "snapshots": gathered.records,
                        "blocks": [d.hex() for d in gathered.blocks], "arrays": writer.arrays,
                        "chunk": CHUNK, "checksums": writer.checksums()}
            text = json.dumps(manifest).encode()
            out.seek(0)
            out.write(MAGIC + VERSION.pack(FORMAT_VERSION))
            out.seek(writer.end)
            out.write(text)
            out.write(FOOTER.pack(writer.end, len(text), zlib.crc32(text), END))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    finally:
        with _OWN_LOCK:
            _OWN_TEMPORARIES.discard(temporary)
    return os.path.getsize(path)


# Temporaries: `.prefix-cache-<file name>.<8 random characters>.tmp` beside the file (named
# after it, so that servers with other files in the same directory keep theirs), and the ones
# this process is writing now (a second engine's start must not remove them).
_OWN_TEMPORARIES: set[str] = set()
_OWN_LOCK = threading.Lock()
_LEGACY_TEMPORARY = re.compile(r"\.prefix-cache-[a-z0-9_]{8}")   # earlier builds' (no file name)


def _new_temporary(path: str) -> tuple[int, str]:
    directory, name = os.path.split(os.path.abspath(path))
    with _OWN_LOCK:
        handle, temporary = tempfile.mkstemp(prefix=f".prefix-cache-{name}.", suffix=".tmp",
                                             dir=directory)
        _OWN_TEMPORARIES.add(temporary)
    return handle, temporary


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporaries of `path`'s saves that this process is not writing (a save cut
    short by a kill leaves one: the rename never came); the names removed."""
    directory, name = os.path.split(os.path.abspath(path))
    ours = re.compile(re.escape(f".prefix-cache-{name}.") + r"[a-z0-9_]{8}\.tmp")
    try:
        names = sorted(os.listdir(directory))
    except OSError:            # no directory (yet) or an unreadable one: the save will say so
        return []
    removed = []
    with _OWN_LOCK:
        for entry in names:
            full = os.path.join(directory, entry)
            if (ours.fullmatch(entry) or _LEGACY_TEMPORARY.fullmatch(entry)) \
                    and full not in _OWN_TEMPORARIES and os.path.isfile(full):
                try:
                    os.unlink(full)
                except OSError:   # another start removed it first, or not ours to remove
                    continue
                removed.append(entry)
    return removed


class _Writer:
    """The data section of a file being written: each array is laid out when its first items
    arrive (their shapes are the runner's), and items are written in place."""

    def __init__(self, fd: int):
        self.fd = fd
        self.end = DATA_START
        self.arrays: dict[str, list[dict]] = {}      # kind -> one descriptor per part

    def put(self, kind: str, parts: HostArrays, axis: int, at: int, total: int) -> None:
        """Write items at..at+n-1 of `total` of `kind`: `parts` holds n items on `axis`."""
        if kind not in self.arrays:
            self.arrays[kind] = []
            for part in parts:
                shape = list(part.shape)
                shape[axis] = total
                offset = -(-self.end // ALIGN) * ALIGN
                self.arrays[kind].append({"dtype": part.dtype.str, "shape": shape,
                                          "offset": offset})
                self.end = offset + int(np.prod(shape)) * part.dtype.itemsize
        layout = self.arrays[kind]
        if len(parts) != len(layout):
            raise ValueError(f"{kind} copies of {len(parts)} parts after ones of {len(layout)}")
        for part, desc in zip(parts, layout):
            shape = list(part.shape)
            count, shape[axis] = shape[axis], desc["shape"][axis]
            if part.dtype.str != desc["dtype"] or shape != desc["shape"]:
                raise ValueError(f"{kind} copies of differing layouts: {part.dtype}{part.shape} "
                                 f"after {desc['dtype']}{desc['shape']}")
            outer = int(np.prod(part.shape[:axis]))
            rows = np.ascontiguousarray(part).view(np.uint8).reshape(outer, -1)
            item = rows.shape[1] // max(count, 1)           # bytes of one item in one outer row
            for o in range(outer):
                _pwrite(self.fd, rows[o], desc["offset"] + (o * total + at) * item)

    def checksums(self) -> list[int]:
        """CRC-32 of each `CHUNK` of the data section, read back through a mapping of the
        file (written in place, out of order; the page cache still holds it: no copy)."""
        if self.end == DATA_START:
            return []
        with mmap.mmap(self.fd, self.end, access=mmap.ACCESS_READ) as mapped, \
                ThreadPoolExecutor(THREADS) as pool:
            def crc(start: int) -> int:
                with memoryview(mapped) as whole, whole[start:start + CHUNK] as piece:
                    return zlib.crc32(piece)
            return list(pool.map(crc, range(DATA_START, self.end, CHUNK)))


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


# --- reading --------------------------------------------------------------------------------

def load_cache_file(path: str, fingerprint: str, cache: PrefixCache, warn,
                    buffer: Callable[[int], Optional[np.ndarray]] = lambda nbytes: None) -> tuple[int, int]:
    """Read a file written by `save_cache_file` into the host tier; returns the snapshots
    restored and the bytes read. A missing file restores nothing silently; an unusable one
    calls `warn(reason)` once and restores nothing. buffer(nbytes): a uint8 array to read the
    data into, or None for a fresh one (`ModelRunner.host_buffer`: the runner's pinned memory,
    from which the pages and states go back to the GPU at the copy engine's speed instead of
    through the driver's pageable staging; 2.5 s of the first turn after a restart at 100K
    tokens, measured on the H200)."""
    if not os.path.exists(path):
        return 0, 0
    try:
        with open(path, "rb", buffering=0) as handle:
            manifest, data = _read(handle, fingerprint, buffer)
            return _restore(manifest, data, cache), os.fstat(handle.fileno()).st_size
    except _Unusable as exc:
        warn(f"prefix cache file {path} ignored: {exc}")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError,
            struct.error) as exc:
        warn(f"prefix cache file {path} ignored: unreadable ({type(exc).__name__}: {exc})")
    return 0, 0


def read_manifest(path: str) -> dict:
    """The manifest of a good file (its records: tests, tools); raises when it is unusable."""
    with open(path, "rb", buffering=0) as handle:
        return _manifest(handle, None)


def _manifest(handle, fingerprint: Optional[str]) -> dict:
    """The file's manifest, its version, footer, checksum and fingerprint checked."""
    size = os.fstat(handle.fileno()).st_size
    head = handle.read(len(MAGIC) + VERSION.size)
    if head.startswith(b"PK\x03\x04"):                   # format 1 was a zip (.npz) archive
        raise _Unusable(f"format version 1 (an .npz archive), this build reads {FORMAT_VERSION}")
    if len(head) < len(MAGIC) + VERSION.size or not head.startswith(MAGIC):
        raise _Unusable("unreadable (not a prefix cache file)")
    (version,) = VERSION.unpack_from(head, len(MAGIC))
    if version != FORMAT_VERSION:
        raise _Unusable(f"format version {version}, this build reads {FORMAT_VERSION}")
    if size < DATA_START + FOOTER.size:
        raise _Unusable(f"unreadable (truncated: {size} bytes)")
    handle.seek(size - FOOTER.size)
    offset, length, crc, end = FOOTER.unpack(_read_exactly(handle, FOOTER.size))
    if end != END or offset < DATA_START or offset + length + FOOTER.size != size:
        raise _Unusable(f"unreadable (truncated or damaged: {size} bytes, no valid footer)")
    handle.seek(offset)
    text = _read_exactly(handle, length)
    if zlib.crc32(text) != crc:
        raise _Unusable("unreadable (the manifest's checksum does not match)")
    manifest = json.loads(text.decode())
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        raise _Unusable(f"written for {manifest['fingerprint']!r}, this server is "
                        f"{fingerprint!r} (another model, artifact, runner build or KV format)")
    manifest["data_end"] = offset
    return manifest


def _read(handle, fingerprint: str, buffer: Callable[[int], Optional[np.ndarray]]) -> tuple[dict, np.ndarray]:
    """The manifest and the data section (from `DATA_START`, into `buffer`'s array where it
    gives one), every chunk's checksum passed."""
    manifest = _manifest(handle, fingerprint)
    end, chunk = manifest["data_end"], manifest["chunk"]
    if not isinstance(chunk, int) or chunk < 1 \
            or len(manifest["checksums"]) != len(chunks := range(DATA_START, end, chunk)):
        raise _Unusable(f"unreadable ({len(manifest['checksums'])} checksums for "
                        f"{end - DATA_START} bytes in chunks of {chunk})")
    data = buffer(end - DATA_START)
    if data is None:
        data = np.empty(end - DATA_START, np.uint8)
    view = memoryview(data)
    fd = handle.fileno()

    def read_and_check(start: int) -> Optional[str]:
        """Read one chunk into its place and check it; what is wrong with it, if anything."""
        piece = view[start - DATA_START:min(start + chunk, end) - DATA_START]
        got = 0
        while got < piece.nbytes:                      # a short read: the rest, or the end
            more = os.preadv(fd, [piece[got:]], start + got)
            if not more:
                return f"truncated at byte {start + got}"
            got += more
        if zlib.crc32(piece) != manifest["checksums"][(start - DATA_START) // chunk]:
            return f"checksum mismatch in bytes {start}..{start + piece.nbytes - 1}"
        return None

    # Chunks are read and checked on threads (both drop the GIL): from the page cache a read is
    # a copy into fresh memory, bound by one core's page faults and copies when done in line
    # (~0.5-1 GB/s on the 2-core dev VM, where two threads measured the same: noise of +-50 %).
    with ThreadPoolExecutor(THREADS) as pool:
        problem = next((p for p in pool.map(read_and_check, chunks) if p is not None), None)
    if problem is not None:
        raise _Unusable(f"unreadable ({problem})")
    return manifest, data


def _arrays(manifest: dict, data: np.ndarray, kind: str, axis: int, count: int) -> HostArrays:
    """The parts of one array group, views into `data`, their bounds and counts checked."""
    parts = []
    for desc in manifest["arrays"].get(kind, []) if count else []:
        dtype, shape, offset = np.dtype(desc["dtype"]), tuple(desc["shape"]), desc["offset"]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if offset % ALIGN or offset < DATA_START or offset + nbytes > manifest["data_end"] \
                or len(shape) <= axis or shape[axis] != count:
            raise _Unusable(f"unreadable (its {kind} array {desc} does not fit the file)")
        start = offset - DATA_START
        parts.append(data[start:start + nbytes].view(dtype).reshape(shape))
    if count and not parts:
        raise _Unusable(f"unreadable (no {kind} arrays for {count} items)")
    return tuple(parts)


def _restore(manifest: dict, data: np.ndarray, cache: PrefixCache) -> int:
    records = manifest["snapshots"]
    digests = [bytes.fromhex(d) for d in manifest["blocks"]]
    tails = [r["tail_page"] for r in records if r["tail_page"] is not None]
    pages = _arrays(manifest, data, "page", 1, len(digests) + len(tails))
    states = _arrays(manifest, data, "state", 0, len(records))
    page_bytes = sum(part[:, 0].nbytes for part in pages)
    if pages and cache.config.page_nbytes and page_bytes != cache.config.page_nbytes:
        raise _Unusable(f"unreadable (pages of {page_bytes} bytes, this runner's are "
                        f"{cache.config.page_nbytes})")

    def page(k: int) -> HostCopy:
        return HostCopy.of(tuple(part[:, k:k + 1] for part in pages))

    block_copies = [page(k) for k in range(len(digests))]
    restored, kept = 0, []
    # Deepest first: when the host budget runs out, the longest prefixes are the ones kept.
    for i in sorted(range(len(records)), key=lambda i: -records[i]["position"]):
        record = records[i]
        chain = tuple(digests[k] for k in record["chain"])
        state = HostCopy.of(tuple(part[i] for part in states))
        tail = page(record["tail_page"]) if record["tail_page"] is not None else None
        if cache.restore_entry(int(record["position"]), chain, tuple(int(t) for t in record["tail"]),
                               state, tail, {digests[k]: block_copies[k] for k in record["chain"]}):
            restored += 1
            kept += [state] + ([tail] if tail is not None else [])
    kept += [c for d, c in zip(digests, block_copies) if cache.host_block(d) is c]
    if sum(c.nbytes for c in kept) < sum(p.nbytes for p in pages + states):
        # The budget took only part of the file: copy that part out so the file's buffer,
        # which every view keeps alive, goes (the host tier counts only what it kept).
        for copy in kept:
            copy.data = HostReady(tuple(part.copy() for part in copy.data.wait()))
    return restored


def _read_exactly(handle, nbytes: int) -> bytes:
    data = handle.read(nbytes)
    if len(data) != nbytes:
        raise _Unusable(f"unreadable (truncated: {len(data)} of {nbytes} bytes)")
    return data
