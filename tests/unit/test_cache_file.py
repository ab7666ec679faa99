"""The prefix cache file (`runtime.engine.cache_file`, format 2): a file of many blocks, from
the device in runs and from the host tier, round-trips exactly; a flipped byte, a truncation
and an old format version are each one warning and nothing restored; a host budget that takes
part of a file keeps only that part in memory; shutdown waits for the last save."""

from __future__ import annotations

import time

import numpy as np
import pytest

from runtime.engine import cache_file
from runtime.engine.cache_file import load_cache_file, read_manifest, save_cache_file
from runtime.engine.cache_ops import HostCopy, apply_ops, Traffic
from runtime.engine.kv_blocks import BlockManager, block_hashes
from runtime.engine.prefix_cache import PrefixCache, PrefixCacheConfig
from runtime.model.runner import PAGE_SIZE, HostReady

LAYERS, HEADS, DIM = 3, 2, 4          # K and V parts: [LAYERS, pages, 64, HEADS, DIM] float32
STATE, CONV = (2, 3, 5), (2, 7)       # a slot's parts: [2, 3, 5] float32, [2, 7] float16
BLOCKS = 150
HOST_BLOCKS = {40, 41, 100}           # chain blocks only in the host tier; the rest on device


class PoolRunner:
    """The runner side of a save: random KV pages and slots, read_pages calls recorded."""

    def __init__(self, num_pages: int, num_slots: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        shape = (LAYERS, num_pages, PAGE_SIZE, HEADS, DIM)
        self.keys = rng.standard_normal(shape, dtype=np.float32)
        self.values = rng.standard_normal(shape, dtype=np.float32)
        self.states = rng.standard_normal((num_slots, *STATE), dtype=np.float32)
        self.conv = rng.standard_normal((num_slots, *CONV)).astype(np.float16)
        self.reads: list[list[int]] = []
        self.page_nbytes = self.keys[:, 0].nbytes * 2
        self.slot_nbytes = self.states[0].nbytes + self.conv[0].nbytes

    def read_pages(self, pages):
        self.reads.append(list(pages))
        return HostReady((self.keys[:, pages].copy(), self.values[:, pages].copy()))

    def save_slot(self, slot):
        return HostReady((self.states[slot].copy(), self.conv[slot].copy()))

    def copy_slot(self, src, dst):
        self.states[dst], self.conv[dst] = self.states[src], self.conv[src]


def new_cache(runner: PoolRunner, host_bytes: int = 1 << 30, num_pages: int = 256) -> PrefixCache:
    config = PrefixCacheConfig(snapshot_slots=(4, 5), host_bytes=host_bytes,
                               slot_nbytes=runner.slot_nbytes, page_nbytes=runner.page_nbytes)
    return PrefixCache(config, BlockManager(num_pages))


def page_of(runner: PoolRunner, page: int):
    return runner.keys[:, page:page + 1].copy(), runner.values[:, page:page + 1].copy()


def state_of(runner: PoolRunner, slot: int):
    return runner.states[slot].copy(), runner.conv[slot].copy()


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """A file of three snapshots over a 150-block chain: the deepest (a device slot), one with
    a tail page and one 40 blocks deep (host states); 147 blocks on the device, 3 on the host.
    Small chunks and runs, so the file has many of each. Returns (path, what each holds)."""
    monkeypatch.setattr(cache_file, "CHUNK", 4096)
    monkeypatch.setattr(cache_file, "RUN_PAGES", 16)
    runner = PoolRunner(num_pages=256, num_slots=6)
    cache = new_cache(runner)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 1000, BLOCKS * PAGE_SIZE + 10)]
    digests = block_hashes(tokens[:BLOCKS * PAGE_SIZE])
    pages = cache.blocks.allocate(BLOCKS, "a")
    expected_blocks = {}
    for i, (digest, page) in enumerate(zip(digests, pages)):
        expected_blocks[digest] = page_of(runner, page)
        if i not in HOST_BLOCKS:
            cache.blocks.publish(page, digest)
    tail_page, lane = 200, 0
    expected = {  # position -> (state, tail page)
        BLOCKS * PAGE_SIZE + 10: (state_of(runner, 1), page_of(runner, tail_page)),
        40 * PAGE_SIZE: (state_of(runner, 2), None)}
    for position, (state, tail) in expected.items():
        chain = tuple(digests[:position // PAGE_SIZE])
        assert cache.restore_entry(
            position, chain, tuple(tokens[len(chain) * PAGE_SIZE:position]), HostCopy.of(state),
            None if tail is None else HostCopy.of(tail),
            {d: HostCopy.of(expected_blocks[d]) for d in chain})
    assert cache.capture(tokens, BLOCKS * PAGE_SIZE, digests, pages, lane)
    apply_ops(runner, cache.take_ops(), Traffic())           # lane 0 -> a snapshot slot
    expected[BLOCKS * PAGE_SIZE] = (state_of(runner, lane), None)
    cache.check()
    path = tmp_path / "prefix.cache"
    size = save_cache_file(str(path), "fp", cache, runner)
    assert size == path.stat().st_size
    # Device blocks come in runs that follow the chain, each at most RUN_PAGES long: 0..39,
    # 42..99 and 101..149 (the host blocks between them are not read from the device).
    device = [i for i in range(BLOCKS) if i not in HOST_BLOCKS]
    assert [p for run in runner.reads for p in run] == [pages[i] for i in device]
    assert [len(run) for run in runner.reads] == [16, 16, 8, 16, 16, 16, 10, 16, 16, 16, 1]
    return path, expected, expected_blocks, tokens, runner


def restored(cache: PrefixCache):
    return {e.position: e for e in cache.entries()}


def test_a_file_of_many_blocks_round_trips_exactly(saved):
    path, expected, expected_blocks, tokens, runner = saved
    warnings = []
    cache = new_cache(runner)
    count, nbytes = load_cache_file(str(path), "fp", cache, warnings.append)
    assert warnings == [] and count == 3 and nbytes == path.stat().st_size
    entries = restored(cache)
    assert sorted(entries) == sorted(expected)
    for position, (state, tail) in expected.items():
        entry = entries[position]
        assert entry.tail == tuple(tokens[position // PAGE_SIZE * PAGE_SIZE:position])
        for got, want in zip(entry.state.data.wait(), state, strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        if tail is None:
            assert entry.tail_copy is None
        else:
            for got, want in zip(entry.tail_copy.data.wait(), tail, strict=True):
                assert np.array_equal(got, want)
    for digest, (keys, values) in expected_blocks.items():
        got_keys, got_values = cache.host_block(digest).data.wait()
        assert np.array_equal(got_keys, keys) and np.array_equal(got_values, values)
        # Everything fitted: the host tier holds views into the one buffer read, no copies.
        assert not got_keys.flags.owndata
    cache.check()
    manifest = read_manifest(str(path))
    assert len(manifest["checksums"]) > 100           # 4 KiB chunks: many checked


def test_a_flipped_byte_in_the_block_array_is_detected(saved):
    path, *_ , runner = saved
    keys = read_manifest(str(path))["arrays"]["page"][0]
    middle = keys["offset"] + int(np.prod(keys["shape"])) * 4 // 2
    data = bytearray(path.read_bytes())
    data[middle] ^= 0x10
    path.write_bytes(bytes(data))
    warnings = []
    cache = new_cache(runner)
    assert load_cache_file(str(path), "fp", cache, warnings.append) == (0, 0)
    start = middle - (middle - cache_file.DATA_START) % 4096     # the fixture's chunks
    assert warnings == [f"prefix cache file {path} ignored: unreadable (checksum mismatch in "
                        f"bytes {start}..{start + 4095})"]
    assert list(cache.entries()) == [] and cache.host_used == 0


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.001], ids=["footer", "data", "head"])
def test_a_truncated_file_is_detected(saved, keep):
    path, *_, runner = saved
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    warnings = []
    cache = new_cache(runner)
    assert load_cache_file(str(path), "fp", cache, warnings.append) == (0, 0)
    assert len(warnings) == 1 and "unreadable (" in warnings[0], warnings
    assert "truncated" in warnings[0] or "not a prefix cache file" in warnings[0], warnings
    assert list(cache.entries()) == []


def test_an_old_format_version_is_ignored_naming_it(tmp_path):
    runner = PoolRunner(num_pages=4, num_slots=2)
    path = tmp_path / "old.npz"
    # Format 1: an .npz archive with a JSON manifest member.
    manifest = np.frombuffer(b'{"version": 1, "fingerprint": "fp", "snapshots": []}', np.uint8)
    with open(path, "wb") as out:
        np.savez(out, manifest=manifest)
    warnings = []
    assert load_cache_file(str(path), "fp", new_cache(runner), warnings.append) == (0, 0)
    assert warnings == [f"prefix cache file {path} ignored: format version 1 (an .npz "
                        f"archive), this build reads 2"]
    newer = tmp_path / "newer.cache"
    newer.write_bytes(cache_file.MAGIC + (3).to_bytes(4, "little") + bytes(8000))
    warnings = []
    assert load_cache_file(str(newer), "fp", new_cache(runner), warnings.append) == (0, 0)
    assert warnings == [f"prefix cache file {newer} ignored: format version 3, this build reads 2"]


def test_a_host_budget_that_takes_part_of_the_file_keeps_only_that_part(saved):
    path, expected, expected_blocks, tokens, runner = saved
    # Room for one state and the 150 blocks: not for the deepest snapshot (its tail page too),
    # so the next deepest is restored, and a third state does not fit beside it.
    deepest = BLOCKS * PAGE_SIZE
    budget = runner.slot_nbytes + BLOCKS * runner.page_nbytes
    cache = new_cache(runner, host_bytes=budget)
    warnings = []
    count, _ = load_cache_file(str(path), "fp", cache, warnings.append)
    assert warnings == [] and count == 1 and list(restored(cache)) == [deepest]
    entry = restored(cache)[deepest]
    for got, want in zip(entry.state.data.wait(), expected[deepest][0], strict=True):
        assert np.array_equal(got, want) and got.flags.owndata    # copied out of the buffer
    for digest, (keys, values) in expected_blocks.items():
        got_keys, got_values = cache.host_block(digest).data.wait()
        assert np.array_equal(got_keys, keys) and np.array_equal(got_values, values)
        assert got_keys.flags.owndata and got_values.flags.owndata
    assert cache.host_used == budget
    cache.check()


def test_shutdown_waits_for_a_slow_last_save(tiny_dense_path, tmp_path, monkeypatch):
    from runtime.artifact import open_artifact
    from runtime.engine import engine_cache
    from runtime.engine.engine_loop import Engine, EngineConfig
    from runtime.model.numpy_runner import NumpyRunner

    writes = []

    def slow_write(path, gathered):
        time.sleep(1.0)                          # longer than the stop timeout below
        writes.append(path)
        return 1

    monkeypatch.setattr(engine_cache, "write_cache_file", slow_write)
    path = str(tmp_path / "prefix.cache")
    with open_artifact(tiny_dense_path) as artifact:
        runner = NumpyRunner.from_artifact(artifact, num_pages=16, num_slots=4)
        engine = Engine(runner, EngineConfig(num_lanes=2, max_context=512, prefix_cache=True,
                                             snapshot_slots=2, host_cache_bytes=1 << 20,
                                             cache_file=path)).start()
        started = time.monotonic()
        engine.shutdown(timeout=0.3)     # an idle loop reaches its last save at once
        assert writes == [path] and time.monotonic() - started >= 1.0
