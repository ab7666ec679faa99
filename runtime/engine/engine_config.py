"""The engine's capacities and features, fixed at startup (`EngineConfig`).

Its own module because the engine's parts read it: the loop (`engine_loop.py`), the step
executor (`engine_step.py`) and the prefix cache's plumbing (`engine_cache.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runtime.engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Engine capacities (fixed at startup).

    num_lanes: sequences resident at once, 1..8 (`--max-concurrency`; the CLI uses 1).
    max_context: most tokens (prompt + output) of one sequence.
    prefill_chunk: most prompt tokens computed per chunk.
    max_waiting: requests that may wait for a lane; with the running ones this bounds the
        requests in flight (`submit` rejects more with `queue_full`).
    max_batched_tokens: step token budget (None: prefill_chunk + num_lanes).
    num_pages: KV pages to use (None: all the runner has).
    service_turn_tokens: under KV contention, new tokens a sequence produces before it gives
        way to one blocked by pages (bounded service turns, see the scheduler).
    device_sampling: let a runner that can (`samples_on_device`) sample decode rows on its device
        (False: always return logits and sample on the host; benches compare the two).
    speculative: draft proposals verified per round (`runtime.engine.speculative`); decode rows
        then go through `ModelRunner.step` with host sampling, and the runner needs the state
        slots of `SlotLayout.for_config(num_lanes, speculative)`.
    prefix_cache: match prompts against cached prefixes (`runtime.engine.prefix_cache`).
    snapshot_slots: runner slots after those (its spare slots) the cache keeps snapshots in.
    host_cache_bytes: host memory for demoted snapshots and blocks and for paused requests.
        With any of these three, preemption keeps a paused request's state instead of
        replaying it (where there is room); with none, there is no cache at all (the CLI).
    snapshot_interval: long prompts are snapshotted (and chunks end) at multiples of it.
    cache_file / cache_fingerprint: the file tier (`runtime.engine.cache_file`), read at
        construction and written at shutdown; cache_save_s: also written this often (0: not);
        cache_save_bytes: the most host memory a save's copies of device pages and snapshot
        slots may take while it is written (snapshots beyond it are left out, deepest kept).
    ssd_bytes / ssd_dir / ssd_write_bytes_per_hour: the disk tier (`runtime.engine.disk_tier`;
        0 bytes: none), its directory and its write budget; its files carry cache_fingerprint.
    """

    num_lanes: int = 1
    max_context: int = 2048
    prefill_chunk: int = 1024
    max_waiting: int = 16
    max_batched_tokens: Optional[int] = None
    num_pages: Optional[int] = None
    service_turn_tokens: int = 128
    device_sampling: bool = True
    speculative: SpeculativeConfig = SpeculativeConfig()
    prefix_cache: bool = False
    snapshot_slots: int = 0
    host_cache_bytes: int = 0
    snapshot_interval: int = 0
    cache_file: Optional[str] = None
    cache_fingerprint: str = ""
    cache_save_s: float = 0.0
    cache_save_bytes: int = 16 << 30
    ssd_bytes: int = 0
    ssd_dir: Optional[str] = None
    ssd_write_bytes_per_hour: int = 8 << 30
