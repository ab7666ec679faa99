"""The prefix cache file with `CudaRunner` on the null device: the save reads device blocks in
runs (one copy per layer part per run of consecutive pages, not one per block), and a resume
from the file's host copies (views into the buffer it was read into: the runner's pinned
memory) writes back exactly the bytes that were on the device, into a pool and slots wiped in
between. Needs the built kernels.
"""

from __future__ import annotations

import numpy as np

from runtime.engine.cache_file import load_cache_file, save_cache_file
from runtime.engine.cache_ops import HostCopy, Traffic, apply_ops
from runtime.engine.kv_blocks import BlockManager, block_hashes
from runtime.engine.prefix_cache import PrefixCache, PrefixCacheConfig
from runtime.model.runner import PAGE_SIZE, HostReady

from null_cuda import built_or_skip
from test_host_copies_null import OrderDevice

BLOCKS, HOST_BLOCK = 10, 5          # chain blocks on pages 0..9; block 5 only in the host tier


def random_pool(runner, seed: int) -> None:
    """Random bytes in every page and slot (so a wrong copy cannot match by accident)."""
    rng = np.random.default_rng(seed)
    layers, _, page_bytes = runner.read_pages([0]).wait()[0].shape
    shape = (layers, runner.num_pages, page_bytes)
    every = list(range(runner.num_pages))
    runner.write_pages(every, HostReady(tuple(rng.integers(0, 256, shape, dtype=np.uint8)
                                              for _ in range(2))))
    for slot in range(runner.num_slots):
        states, windows = runner.save_slot(slot).wait()
        runner.load_slot(slot, HostReady((rng.integers(0, 256, states.shape, dtype=np.uint8),
                                          rng.integers(0, 256, windows.shape, dtype=np.uint8))))


def test_a_cuda_runner_saves_in_runs_and_resumes_the_same_bytes_from_the_file(tiny_dense_path, tmp_path):
    from runtime.model.gpu.runner import CudaRunner

    device = OrderDevice(total_memory=2 << 30)
    runner = built_or_skip(lambda: CudaRunner.from_artifact(tiny_dense_path, num_pages=16, num_slots=4,
                                                            device=device, prefill_chunk=64))
    try:
        assert runner.reserve_host_copies(8 << 20) == 8 << 20   # a slot goes out via staging
        random_pool(runner, seed=1)
        config = PrefixCacheConfig(snapshot_slots=(2, 3), host_bytes=64 << 20,
                                   slot_nbytes=runner.slot_nbytes, page_nbytes=runner.page_nbytes)
        cache = PrefixCache(config, BlockManager(runner.num_pages))
        tokens = list(range(1, BLOCKS * PAGE_SIZE + 1))
        digests = block_hashes(tokens)
        pages = cache.blocks.allocate(BLOCKS, "a")
        before = {d: tuple(a.copy() for a in runner.read_pages([p]).wait())
                  for d, p in zip(digests, pages)}
        for i, (digest, page) in enumerate(zip(digests, pages)):
            if i != HOST_BLOCK:
                cache.blocks.publish(page, digest)
        # A host-state snapshot half way (bringing the host block), then the deepest from lane 0.
        half = tuple(digests[:BLOCKS // 2 + 1])
        assert cache.restore_entry(len(half) * PAGE_SIZE, half, (),
                                   HostCopy.of(runner.save_slot(1).wait()), None,
                                   {digests[HOST_BLOCK]: HostCopy.of(before[digests[HOST_BLOCK]])})
        assert cache.capture(tokens, BLOCKS * PAGE_SIZE, digests, pages, 0)
        apply_ops(runner, cache.take_ops(), Traffic())
        lane_state = tuple(a.copy() for a in runner.save_slot(0).wait())
        device.log.clear()
        path = tmp_path / "prefix.cache"
        save_cache_file(str(path), "fp", cache, runner)
        layers = len(runner.storage.k_pages)
        pages_out = [e for e in device.log if e[0] == "dtoh" and e[2] != runner.copies.staging]
        # Two runs (blocks 0..4 and 6..9, each of consecutive pages): K and V per layer each.
        assert len(pages_out) == 2 * 2 * layers

        random_pool(runner, seed=2)                              # the restart's wiped device
        fresh = PrefixCache(config, BlockManager(runner.num_pages))
        warnings = []
        assert load_cache_file(str(path), "fp", fresh, warnings.append, runner.host_buffer)[0] == 2
        assert warnings == []
        deepest = max(fresh.entries(), key=lambda e: e.position)
        # The file was read into the runner's pinned memory: the copies in start from there.
        assert all(runner.copies.pool.contains(a) for e in fresh.entries() for a in e.state.data.wait())
        table = fresh.resume(deepest, "b", lane=1)
        apply_ops(runner, fresh.take_ops(), Traffic())
        for digest, page in zip(digests, table):
            for got, want in zip(runner.read_pages([page]).wait(), before[digest], strict=True):
                np.testing.assert_array_equal(got, want)
        for got, want in zip(runner.save_slot(1).wait(), lane_state, strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        runner.close()
