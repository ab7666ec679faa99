"""The prefix cache file's two-phase save (`runtime.engine.cache_file.gather_cache_file` on the
engine thread, `write_cache_file` on a writer thread): the engine serves while a slow write
runs, a periodic save due meanwhile is skipped, shutdown waits for both writes, the threaded
file equals the one-call save byte for byte, a cache changed after the gather does not change
the file, a budget keeps the deepest snapshots, and a start removes only stale temporaries."""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import pytest

from runtime.engine import cache_file, engine_cache
from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.cache_file import (gather_cache_file, load_cache_file, read_manifest,
                                       remove_stale_temporaries, save_cache_file,
                                       write_cache_file)
from runtime.engine.cache_ops import HostCopy, Traffic, apply_ops
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.kv_blocks import block_hashes
from runtime.model.runner import PAGE_SIZE
from test_cache_file import PoolRunner, new_cache, state_of

CACHE = dict(num_lanes=2, max_context=1024, prefill_chunk=128, prefix_cache=True,
             snapshot_slots=4, host_cache_bytes=64 << 20, snapshot_interval=64,
             cache_fingerprint="tiny-dense;v1")
WAIT_S = 30          # generous bounds for a loaded 2-core VM; a hang fails instead of blocking


class Log:
    """A logger keeping info, warning and error lines."""

    def __init__(self):
        self.infos: list[str] = []
        self.warnings: list[str] = []
        self.errors: list[str] = []

    def info(self, message, *args):
        self.infos.append(message % args if args else message)

    def warning(self, message, *args):
        self.warnings.append(message % args if args else message)

    def debug(self, *args):
        pass

    def error(self, message, *args, **kw):
        self.errors.append(message % args if args else message)


class GatedWriter:
    """`write_cache_file` held until `release` is set (a slow disk), with when each write
    began and ended."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()
        self.started: list[float] = []
        self.ended: list[float] = []

    def __call__(self, path, gathered):
        self.started.append(time.monotonic())
        self.entered.set()
        assert self.release.wait(WAIT_S)
        size = write_cache_file(path, gathered)
        self.ended.append(time.monotonic())
        return size


@pytest.fixture(scope="module")
def make_runner(tiny_dense_path):
    from runtime.artifact import open_artifact
    from runtime.model.numpy_runner import NumpyRunner

    artifact = open_artifact(tiny_dense_path)
    yield lambda: NumpyRunner.from_artifact(artifact, num_pages=48, num_slots=6)
    artifact.close()


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, 440, n))


def serve(engine: Engine, rid: str, tokens: tuple[int, ...]) -> list[int]:
    """A greedy request's ids; fails (instead of hanging) if the engine stops serving."""
    stream = engine.submit(EngineRequest(rid, tokens, SamplingParams(greedy=True), 8))
    ids = []
    while not stream.done:
        try:
            ids += stream.get(timeout=WAIT_S).token_ids
        except queue.Empty:
            pytest.fail(f"{rid} not served within {WAIT_S} s (the engine thread is blocked)")
    return ids


def test_the_engine_serves_while_a_slow_write_runs_and_shutdown_waits_for_both(
        make_runner, tmp_path, monkeypatch):
    gate = GatedWriter()
    monkeypatch.setattr(engine_cache, "write_cache_file", gate)
    path = tmp_path / "prefix.cache"
    log = Log()
    config = EngineConfig(**CACHE, cache_file=str(path), cache_save_s=0.05)
    engine = Engine(make_runner(), config, logger=log).start()
    try:
        first = prompt(1, 150)
        answer = serve(engine, "a", first)
        assert gate.entered.wait(WAIT_S)          # a periodic save gathered; its write is held
        steps = engine.counters["steps"]
        # The next turn (200 tokens): a new snapshot at 192, so the cache changed.
        serve(engine, "b", first + tuple(answer) + prompt(2, 200 - 150 - len(answer)))
        assert engine.counters["steps"] > steps and gate.ended == []
        # The next periods find the write still running: skipped, said in the log.
        deadline = time.monotonic() + WAIT_S
        while not any("save skipped" in line for line in log.infos):
            assert time.monotonic() < deadline, log.infos
            time.sleep(0.01)
        assert len(gate.started) == 1 and engine.cache.saving
    finally:
        threading.Timer(0.3, gate.release.set).start()
        engine.shutdown()
    # The final save began after the held one ended, and both ended before shutdown returned.
    assert len(gate.ended) == 2 and gate.started[1] >= gate.ended[0]
    assert log.warnings == [] and log.errors == []
    # The final file is the one-call save of the cache as shutdown left it, byte for byte.
    same = tmp_path / "one-call.cache"
    save_cache_file(str(same), config.cache_fingerprint, engine.scheduler.cache.cache,
                    engine.runner)
    assert path.read_bytes() == same.read_bytes()
    positions = sorted(r["position"] for r in read_manifest(str(path))["snapshots"])
    assert positions == [64, 128, 192]            # the conversation's prefill stops


def snapshot_cache(runner: PoolRunner, blocks: int):
    """A cache with a device snapshot at `blocks` (lane 0 captured into a slot) and a host
    snapshot half way, over a chain of device blocks; returns (cache, pages, tokens)."""
    cache = new_cache(runner, num_pages=runner.keys.shape[1])
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 1000, blocks * PAGE_SIZE)]
    digests = block_hashes(tokens)
    pages = cache.blocks.allocate(blocks, "a")
    for digest, page in zip(digests, pages):
        cache.blocks.publish(page, digest)
    half = blocks // 2
    assert cache.restore_entry(half * PAGE_SIZE, tuple(digests[:half]), (),
                               HostCopy.of(state_of(runner, 3)), None, {})
    assert cache.capture(tokens, blocks * PAGE_SIZE, digests, pages, 0)
    apply_ops(runner, cache.take_ops(), Traffic())
    return cache, pages, tokens


def test_a_cache_changed_after_the_gather_does_not_change_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_file, "RUN_PAGES", 8)
    runner = PoolRunner(num_pages=40, num_slots=6)
    cache, pages, tokens = snapshot_cache(runner, blocks=20)
    before = tmp_path / "before.cache"
    save_cache_file(str(before), "fp", cache, runner)

    gathered = gather_cache_file("fp", cache, runner)
    # What the engine does meanwhile: every device page and slot rewritten, the chain's pages
    # released and reused (their blocks evicted), a new snapshot restored.
    rng = np.random.default_rng(9)
    runner.keys[:] = rng.standard_normal(runner.keys.shape, dtype=np.float32)
    runner.states[:] = rng.standard_normal(runner.states.shape, dtype=np.float32)
    cache.blocks.release(pages, "a")
    cache.blocks.allocate(40, "b")
    assert cache.blocks.lookup(block_hashes(tokens)[0]) is None
    other = prompt(4, 64)
    assert cache.restore_entry(64, tuple(block_hashes(other)), (),
                               HostCopy.of(state_of(runner, 5)), None,
                               {block_hashes(other)[0]: HostCopy.of((runner.keys[:, :1].copy(),
                                                                     runner.values[:, :1].copy()))})
    after = tmp_path / "after.cache"
    writer = threading.Thread(target=write_cache_file, args=(str(after), gathered))
    writer.start()
    writer.join(WAIT_S)
    assert not writer.is_alive()
    assert after.read_bytes() == before.read_bytes()     # the instant of the gather
    assert gathered.copied_bytes == runner.slot_nbytes + 20 * runner.page_nbytes
    assert gathered.skipped == 0


def test_a_budget_keeps_the_deepest_snapshot_that_fits(tmp_path):
    runner = PoolRunner(num_pages=40, num_slots=6)
    cache, _, _ = snapshot_cache(runner, blocks=20)
    # Room for the deepest (20 device blocks and a device slot) holds the half-way one too (a
    # host state over blocks already counted). One byte less: the deepest does not fit, the
    # half-way one (10 device blocks) does.
    full = runner.slot_nbytes + 20 * runner.page_nbytes
    assert gather_cache_file("fp", cache, runner, budget=full).skipped == 0
    small = gather_cache_file("fp", cache, runner, budget=full - 1)
    assert small.skipped == 1 and small.copied_bytes == 10 * runner.page_nbytes
    assert [r["position"] for r in small.records] == [10 * PAGE_SIZE]
    path = tmp_path / "small.cache"
    write_cache_file(str(path), small)
    fresh = new_cache(runner)
    assert load_cache_file(str(path), "fp", fresh, pytest.fail) == (1, path.stat().st_size)


def test_a_start_removes_only_stale_temporaries_of_its_file(make_runner, tmp_path):
    path = tmp_path / "prefix.cache"
    stale = [".prefix-cache-prefix.cache.ab12cd_4.tmp",      # a save of this file cut short
             ".prefix-cache-x9y8z7w6"]                       # an older build's name
    kept = [".prefix-cache-other.cache.ab12cd34.tmp",        # another cache file's save
            "prefix.cache.ab12cd34.tmp", ".prefix-cache-notes.txt", "notes.tmp",
            ".prefix-cache-prefix.cache.ab12cd34.tmp.bak"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    # A save this process is writing now (another engine's) is not stale.
    handle, writing = cache_file._new_temporary(str(path))
    os.close(handle)
    try:
        log = Log()
        with Engine(make_runner(), EngineConfig(**CACHE, cache_file=str(path)), logger=log):
            pass
        left = sorted(os.listdir(tmp_path))
        assert left == sorted(kept + [os.path.basename(writing), "prefix.cache"])
        assert [line for line in log.infos if "temporary" in line] == [
            f"prefix cache: removed 2 temporary files of saves cut short: {', '.join(sorted(stale))}"]
    finally:
        cache_file._OWN_TEMPORARIES.discard(writing)
    # Once this process is done with it, it is stale too.
    assert remove_stale_temporaries(str(path)) == [os.path.basename(writing)]
    # A file in a directory not made yet: nothing to remove, no error (its save will warn).
    assert remove_stale_temporaries(str(tmp_path / "missing" / "prefix.cache")) == []


def test_an_engine_save_over_its_budget_leaves_snapshots_out_and_says_so(make_runner, tmp_path):
    path = tmp_path / "prefix.cache"
    log = Log()
    # No room for any device copy: every snapshot needs device blocks (or its device slot).
    config = EngineConfig(**CACHE, cache_file=str(path), cache_save_bytes=0)
    with Engine(make_runner(), config, logger=log) as engine:
        serve(engine, "a", prompt(1, 150))
    held = sorted(e.position for e in engine.scheduler.cache.cache.shared_entries())
    assert held == [64, 128]
    assert log.warnings == ["prefix cache save: 2 snapshots left out, their copies would pass "
                            "0 MiB"]
    assert read_manifest(str(path))["snapshots"] == []
