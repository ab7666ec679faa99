"""The engine thread's side of the prefix cache: its capacities from `EngineConfig`, the file
tier (`runtime.engine.cache_file`: read at construction, written at shutdown and every
`cache_save_s`, only when the cache changed; a save's copies are gathered on the engine thread
and written by a writer thread, one save at a time), the disk tier (`runtime.engine.disk_tier`:
attached to the cache here, its writes run with the queued operations), the storage
operations it queues (`runtime.engine.cache_ops`: run on the runner, in order) and its
/metrics numbers.

The scheduler owns the cache's bookkeeping (`Scheduler.cache`, a `SequenceCache`); the engine
reaches the runner side of it only through `EngineCache`.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from runtime.engine.cache_file import (Gathered, gather_cache_file, load_cache_file,
                                       remove_stale_temporaries, write_cache_file)
from runtime.engine.cache_ops import Traffic, apply_ops
from runtime.engine.disk_tier import DiskTier, DiskTierConfig
from runtime.engine.engine_config import EngineConfig
from runtime.engine.prefix_cache import PrefixCacheConfig
from runtime.engine.scheduler import Scheduler
from runtime.engine.speculative import SlotLayout
from runtime.model.runner import ModelRunner


def prefix_cache_config(runner: ModelRunner, config: EngineConfig) -> Optional[PrefixCacheConfig]:
    """The prefix cache's capacities, or None when the config asks for no cache at all."""
    if not (config.prefix_cache or config.snapshot_slots or config.host_cache_bytes):
        return None
    first = SlotLayout.for_config(config.num_lanes, config.speculative).first_spare
    if first + config.snapshot_slots > runner.num_slots:
        raise ValueError(f"the runner has {runner.num_slots} state slots; lanes and speculative "
                         f"snapshots take {first}, {config.snapshot_slots} snapshot slots asked")
    return PrefixCacheConfig(reuse=config.prefix_cache,
                             snapshot_slots=tuple(range(first, first + config.snapshot_slots)),
                             host_bytes=config.host_cache_bytes, slot_nbytes=runner.slot_nbytes,
                             page_nbytes=runner.page_nbytes)


class EngineCache:
    """The prefix cache's storage work on the engine thread; each call does nothing when the
    scheduler has no cache."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, scheduler: Scheduler,
                 logger=None):
        self.runner = runner
        self.config = config
        self.scheduler = scheduler
        self.traffic = Traffic()
        self._logger = logger
        self._saved_at = time.monotonic()
        self._saved_changes = 0
        self._writer: Optional[threading.Thread] = None     # the save being written, if any
        self.disk: Optional[DiskTier] = None
        warn = logger.warning if logger is not None else (lambda message: None)
        if scheduler.cache is not None and config.host_cache_bytes:
            # The host tier's copies in memory the runner set aside (pinned on the GPU), so a
            # demotion never holds up a step; without it they still work, waiting for the device.
            pinned = runner.reserve_host_copies(config.host_cache_bytes)
            if pinned < config.host_cache_bytes:
                warn(f"prefix cache: only {pinned >> 20} of {config.host_cache_bytes >> 20} MiB of "
                     "host memory could be set aside for copies; the rest waits for the device")
        if config.ssd_bytes and scheduler.cache is not None:
            self.disk = DiskTier(DiskTierConfig(
                directory=config.ssd_dir, cap_bytes=config.ssd_bytes,
                write_bytes_per_hour=config.ssd_write_bytes_per_hour,
                fingerprint=config.cache_fingerprint, slot_nbytes=runner.slot_nbytes,
                page_nbytes=runner.page_nbytes), warn)
            scheduler.cache.cache.disk = self.disk
            if logger is not None:
                logger.info("prefix cache disk tier: %s, %.1f GiB, %d earlier files removed",
                            config.ssd_dir, config.ssd_bytes / (1 << 30),
                            self.disk.removed_at_start)
        # The file tier's last read and write (/metrics: how long a restart's read took).
        # gather_seconds: how long the last save held up the engine thread.
        self.file_numbers = {"prefix_cache_file_read_bytes": 0,
                             "prefix_cache_file_read_seconds": 0.0,
                             "prefix_cache_file_written_bytes": 0,
                             "prefix_cache_file_write_seconds": 0.0,
                             "prefix_cache_file_gather_seconds": 0.0}
        if config.cache_file is not None and scheduler.cache is not None:
            removed = remove_stale_temporaries(config.cache_file)
            if removed and logger is not None:
                logger.info("prefix cache: removed %d temporary files of saves cut short: %s",
                            len(removed), ", ".join(removed))
            started = time.perf_counter()
            restored, nbytes = load_cache_file(config.cache_file, config.cache_fingerprint,
                                               scheduler.cache.cache, warn, runner.host_buffer)
            seconds = time.perf_counter() - started
            self.file_numbers.update(prefix_cache_file_read_bytes=nbytes,
                                     prefix_cache_file_read_seconds=seconds)
            if logger is not None and nbytes:
                logger.info("prefix cache: %d snapshots restored from %s (%.1f MiB read in "
                            "%.2f s)", restored, config.cache_file, nbytes / (1 << 20), seconds)
            self._saved_changes = scheduler.cache.cache.changes    # the file holds these

    def apply_ops(self) -> None:
        """Run the prefix cache's queued copies (`runtime.engine.cache_ops`), in order."""
        if self.scheduler.cache is not None:
            apply_ops(self.runner, self.scheduler.cache.cache.take_ops(), self.traffic,
                      self.disk.spill if self.disk is not None else None)

    def save_due_in(self) -> Optional[float]:
        """Seconds until the periodic file-tier save is due (None: there is none), so that an
        idle engine thread wakes for it instead of waiting for its next request."""
        if self.config.cache_file is None or self.scheduler.cache is None \
                or not self.config.cache_save_s:
            return None
        return max(0.0, self._saved_at + self.config.cache_save_s - time.monotonic())

    def save(self, periodic: bool) -> None:
        """Save the file tier: at shutdown, or when `cache_save_s` has passed since the last
        save and the cache's entries changed since (an idle engine rewrites nothing). This
        thread gathers the copies (`gather_cache_file`: bounded by copy bandwidth); a writer
        thread writes them. A periodic save due while the last one is still being written is
        skipped (logged); the one at shutdown waits for it, then for its own write. A failed
        write is logged; the cache keeps serving."""
        cache = self.scheduler.cache
        if self.config.cache_file is None or cache is None:
            return
        if periodic and not (self.config.cache_save_s
                             and time.monotonic() - self._saved_at >= self.config.cache_save_s):
            return
        self._saved_at = time.monotonic()
        if periodic and cache.cache.changes == self._saved_changes:
            return
        if periodic and self.saving:
            if self._logger is not None:
                self._logger.info("prefix cache save skipped: the last one is still being "
                                  "written to %s", self.config.cache_file)
            return
        self.wait_for_save()
        self._saved_changes = cache.cache.changes
        started = time.perf_counter()
        gathered = gather_cache_file(self.config.cache_fingerprint, cache.cache, self.runner,
                                     self.config.cache_save_bytes)
        gather_s = time.perf_counter() - started
        self.file_numbers["prefix_cache_file_gather_seconds"] = gather_s
        if gathered.skipped and self._logger is not None:
            self._logger.warning("prefix cache save: %d snapshots left out, their copies would "
                                 "pass %.0f MiB", gathered.skipped,
                                 self.config.cache_save_bytes / (1 << 20))
        self._writer = threading.Thread(target=self._write, args=(gathered, gather_s),
                                        name="infernix-cache-save")
        self._writer.start()
        if not periodic:
            self.wait_for_save()

    @property
    def saving(self) -> bool:
        """Whether a save is being written."""
        return self._writer is not None and self._writer.is_alive()

    def wait_for_save(self) -> None:
        """Block until the save being written, if any, is done."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write(self, gathered: Gathered, gather_s: float) -> None:
        """The writer thread: it touches only `gathered` (and the file numbers, each replaced
        whole), never the live cache."""
        started = time.perf_counter()
        try:
            size = write_cache_file(self.config.cache_file, gathered)
        except OSError as exc:
            if self._logger is not None:
                self._logger.warning("prefix cache file %s not written: %s",
                                     self.config.cache_file, exc)
            return
        except Exception:  # noqa: BLE001 - a bug; the thread must report it, the cache serves on
            if self._logger is not None:
                self._logger.error("prefix cache file %s not written", self.config.cache_file,
                                   exc_info=True)
            return
        seconds = time.perf_counter() - started
        self.file_numbers.update(prefix_cache_file_written_bytes=size,
                                 prefix_cache_file_write_seconds=seconds)
        if self._logger is not None:
            self._logger.info("prefix cache written to %s (%.1f MiB: gathered in %.2f s on "
                              "the engine thread, %.1f MiB copied; written in %.2f s, %.0f MB/s)",
                              self.config.cache_file, size / (1 << 20), gather_s,
                              gathered.copied_bytes / (1 << 20), seconds,
                              size / max(seconds, 1e-9) / 1e6)

    def metrics(self) -> dict:
        """The cache's part of `Engine.snapshot()` (empty without a cache)."""
        cache = self.scheduler.cache
        if cache is None:
            return {}
        pages = self.scheduler.pages
        traffic = self.traffic
        # Counters end in _total (they only grow), the rest are gauges (/metrics names).
        numbers = {**{f"prefix_cache_{k}_total": v for k, v in cache.cache.stats.items()},
                "prefix_cache_block_evictions_total": pages.evictions,
                "prefix_cache_host_to_device_bytes_total": traffic.host_to_device_bytes,
                "prefix_cache_device_to_host_bytes_total": traffic.device_to_host_bytes,
                "prefix_cache_slot_copies_total": traffic.device_copies,
                "prefix_cache_cached_pages": pages.num_cached,
                "prefix_cache_device_snapshots": cache.cache.device_snapshots,
                "prefix_cache_host_bytes": cache.cache.host_used}
        if self.config.cache_file is not None:
            numbers.update(self.file_numbers)
        if self.disk is not None:
            # ssd_{bytes_written,bytes_read,hits,read_failures,writes_dropped,evictions}_total
            numbers.update({f"prefix_cache_{k}_total": v for k, v in self.disk.stats.items()})
            numbers["prefix_cache_ssd_bytes"] = self.disk.used
        return numbers
