"""The prefix cache file's own speed (`runtime.engine.cache_file`), on the CPU: a save of N KV
blocks at the 27B shape's page size read from a stand-in runner's pool, in its two halves (the
gather, which holds up the engine thread, and the write, on the writer thread), and the read of
that file back into the host tier.

    python -m bench.cache_file [--blocks 256] [--snapshots 4] [--dir /tmp]

The stand-in runner keeps the CUDA runner's host-copy layout (raw bytes: K and V parts of
[16 attention layers, pages, 128 KiB], a slot of `--slot-mib` in two parts), so the file is
laid out as a GPU server's would be; only the device copies themselves are missing (memcpy
here). A 100K-token conversation is ~1,600 blocks (6.4 GiB) plus its snapshots. The read is
from the page cache (the file was just written, then synced), as after a server restart on the
same host.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from runtime.engine.cache_file import gather_cache_file, load_cache_file, write_cache_file
from runtime.engine.cache_ops import HostCopy
from runtime.engine.kv_blocks import BlockManager, block_hashes
from runtime.engine.prefix_cache import PrefixCache, PrefixCacheConfig
from runtime.model.runner import PAGE_SIZE, HostReady

LAYERS = 16                  # the 27B shape: 16 attention layers ...
LAYER_PAGE_BYTES = PAGE_SIZE * 4 * 256 * 2      # ... x 64 tokens x 4 KV heads x 256 x bf16


class StandInRunner:
    """`read_pages` / `save_slot` over host arrays in the CUDA runner's layout."""

    def __init__(self, num_pages: int, slot_bytes: int, num_slots: int):
        rng = np.random.default_rng(0)
        self.keys = rng.integers(0, 256, (LAYERS, num_pages, LAYER_PAGE_BYTES), np.uint8)
        self.values = rng.integers(0, 256, (LAYERS, num_pages, LAYER_PAGE_BYTES), np.uint8)
        self.slots = rng.integers(0, 256, (num_slots, 2, slot_bytes // 2), np.uint8)
        self.page_nbytes = 2 * LAYERS * LAYER_PAGE_BYTES
        self.slot_nbytes = slot_bytes // 2 * 2

    def read_pages(self, pages):
        # A device copy lands in one contiguous host array per part, as the CUDA runner's.
        return HostReady((np.ascontiguousarray(self.keys[:, pages]),
                          np.ascontiguousarray(self.values[:, pages])))

    def save_slot(self, slot):
        return HostReady((self.slots[slot, :1].copy(), self.slots[slot, 1:].copy()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--snapshots", type=int, default=4, help="spread evenly along the chain")
    ap.add_argument("--slot-mib", type=int, default=150, help="a snapshot's state (27B: ~150)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    runner = StandInRunner(args.blocks, args.slot_mib << 20, args.snapshots)
    config = PrefixCacheConfig(snapshot_slots=tuple(range(args.snapshots)), host_bytes=1 << 50,
                               slot_nbytes=runner.slot_nbytes, page_nbytes=runner.page_nbytes)
    cache = PrefixCache(config, BlockManager(args.blocks))
    tokens = [i % 50_000 for i in range(args.blocks * PAGE_SIZE)]
    digests = block_hashes(tokens)
    for page, digest in zip(cache.blocks.allocate(args.blocks, "bench"), digests):
        cache.blocks.publish(page, digest)
    for n in range(args.snapshots):
        depth = args.blocks * (n + 1) // args.snapshots
        cache.restore_entry(depth * PAGE_SIZE, tuple(digests[:depth]), (),
                            HostCopy.of(runner.save_slot(n).wait()), None, {})
    path = os.path.join(args.dir, "bench-prefix-cache.bin")
    started = time.perf_counter()
    gathered = gather_cache_file("bench", cache, runner)
    gather = time.perf_counter() - started
    size = write_cache_file(path, gathered)
    saved = time.perf_counter() - started
    del gathered
    os.sync()         # as at a restart: the file on disk, not still being written back
    fresh = PrefixCache(config, BlockManager(args.blocks))
    started = time.perf_counter()
    restored, _ = load_cache_file(path, "bench", fresh, print)
    loaded = time.perf_counter() - started
    os.unlink(path)
    assert restored == args.snapshots, restored
    print(f"{args.blocks} blocks + {args.snapshots} snapshots, {size / 2**20:.0f} MiB: "
          f"save {saved:.2f} s ({size / saved / 1e6:.0f} MB/s: gather {gather:.2f} s, "
          f"write {saved - gather:.2f} s), "
          f"read {loaded:.2f} s ({size / loaded / 1e6:.0f} MB/s), {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
