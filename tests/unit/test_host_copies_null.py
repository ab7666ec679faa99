"""`CudaRunner`'s host copies (`runtime.model.gpu.host_copies`) on the null device: which stream
each copy runs on and which events order it, as the driver would receive them.

The null device copies at once, so the values here only show that the right bytes go to the
right place; the order of records, waits and copies in the log is what a GPU would run. The
contract (`ModelRunner.save_slot` and friends in runtime/model/runner.py): a copy out holds the
state as of its call and leaves the source free for the next call; a copy in is complete for
every later call; the host never waits, but in `wait`. Needs the built kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from runtime.cuda.null import NullDevice
from runtime.model.runner import HostReady

from null_cuda import built_or_skip


class OrderDevice(NullDevice):
    """A null device that logs copies, event records, stream waits and host waits in order:
    ("dtoh" | "htod" | "dtod", stream, device address), ("record", event, stream),
    ("wait", stream, event), ("sync", stream), ("event_sync", event), ("query", event);
    events as `id(event.handle)` (the handle a record and a wait share)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.log: list[tuple] = []

    def memcpy_dtoh(self, dst, src, stream=None):
        self.log.append(("dtoh", stream.handle, src))
        return super().memcpy_dtoh(dst, src, stream)

    def memcpy_htod(self, dst, src, stream=None):
        self.log.append(("htod", stream.handle if stream is not None else None, dst))
        super().memcpy_htod(dst, src, stream)

    def memcpy_dtod(self, dst, src, nbytes, stream):
        self.log.append(("dtod", stream.handle, dst))
        super().memcpy_dtod(dst, src, nbytes, stream)

    def event_record(self, event, stream):
        self.log.append(("record", id(event.handle), stream.handle))
        super().event_record(event, stream)

    def stream_wait_event(self, stream, event):
        self.log.append(("wait", stream.handle, id(event.handle)))

    def stream_synchronize(self, stream):
        self.log.append(("sync", stream.handle))

    def event_synchronize(self, event):
        self.log.append(("event_sync", id(event.handle)))

    def event_query(self, event):
        self.log.append(("query", id(event.handle)))
        return True


def make_runner(path, pinned: int):
    from runtime.model.gpu.runner import CudaRunner

    device = OrderDevice(total_memory=2 << 30)
    runner = built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=16, num_slots=4, device=device,
                                                            prefill_chunk=64))
    assert runner.reserve_host_copies(pinned) == pinned
    device.log.clear()
    return runner


@pytest.fixture
def runner(tiny_dense_path):
    r = make_runner(tiny_dense_path, 8 << 20)
    yield r
    r.close()


def fill_slot(runner, slot: int, seed: int) -> None:
    st, phys = runner.storage, runner.slots.phys[slot]
    rng = np.random.default_rng(seed)
    for state, window in zip(st.states, st.windows):
        runner.device.memcpy_htod(state + phys * st.state_slot_bytes,
                                  rng.integers(0, 256, st.state_slot_bytes, dtype=np.uint8))
        runner.device.memcpy_htod(window + phys * st.win_slot_bytes,
                                  rng.integers(0, 256, st.win_slot_bytes, dtype=np.uint8))


def slot_bytes(runner, slot: int) -> bytes:
    st, phys = runner.storage, runner.slots.phys[slot]
    out = b""
    for state in st.states:
        out += runner.device._view(state + phys * st.state_slot_bytes, st.state_slot_bytes).tobytes()
    for window in st.windows:
        out += runner.device._view(window + phys * st.win_slot_bytes, st.win_slot_bytes).tobytes()
    return out


def streams(runner) -> tuple[int, int]:
    return runner.stream.handle, runner.copies.stream.handle


def test_a_slot_goes_out_through_the_staging_slot_and_the_compute_stream_goes_on(runner):
    compute, copy = streams(runner)
    fill_slot(runner, 2, seed=1)
    expected = slot_bytes(runner, 2)
    log = runner.device.log
    log.clear()
    saved = runner.save_slot(2)
    n = len(runner.storage.states)
    staging = runner.copies.staging
    # C: each layer's state and window into the staging slot, then a mark; K waits for the
    # mark and copies the staging slot out in one piece; its own event closes the copy.
    assert log[:2 * n] == [("dtod", compute, staging + at) for at in
                           _offsets(runner.storage, n)]
    mark = log[2 * n][1]
    assert log[2 * n:] == [("record", mark, compute), ("wait", copy, mark), ("dtoh", copy, staging),
                           ("record", id(saved.done.handle), copy)]
    # Nothing makes C wait for K, and the host waits nowhere: the next step is not held up.
    assert runner.copies.pool.contains(saved.arrays[0]) and runner.copies.pool.contains(saved.arrays[1])
    log.clear()
    assert saved.ready() and log == [("query", id(saved.done.handle))]
    log.clear()
    assert b"".join(a.tobytes() for a in saved.wait()) == expected
    assert log == [("event_sync", id(saved.done.handle))]
    # The next slot out reuses the staging slot only once K has read it (C waits, the host not).
    log.clear()
    again = runner.save_slot(1)
    assert log[0] == ("wait", compute, id(saved.done.handle)) and log[1][0] == "dtod"
    assert again.done is not saved.done


def _offsets(storage, n: int) -> list[int]:
    """Where each layer's state, then each layer's window, sits in the staging slot."""
    states = [i * storage.state_slot_bytes for i in range(n)]
    return states + [n * storage.state_slot_bytes + i * storage.win_slot_bytes for i in range(n)]


def test_a_load_runs_on_the_copy_stream_between_two_events(runner):
    compute, copy = streams(runner)
    fill_slot(runner, 2, seed=2)
    saved = runner.save_slot(2)
    fill_slot(runner, 2, seed=3)                 # the source changes at once: the copy holds
    log = runner.device.log
    log.clear()
    runner.load_slot(3, saved)                    # no wait for `saved`: K runs it after the copy
    n = len(runner.storage.states)
    mark = log[0][1]
    assert log[:2] == [("record", mark, compute), ("wait", copy, mark)]
    assert [(kind, stream) for kind, stream, _ in log[2:2 + 2 * n]] == [("htod", copy)] * (2 * n)
    done = log[2 + 2 * n][1]
    assert log[2 + 2 * n:] == [("record", done, copy), ("wait", compute, done)]
    assert slot_bytes(runner, 3) == b"".join(a.tobytes() for a in saved.wait()) != slot_bytes(runner, 2)


def test_pages_out_hold_the_compute_stream_until_copied_and_come_back_exactly(runner):
    compute, copy = streams(runner)
    st = runner.storage
    rng = np.random.default_rng(4)
    data = tuple(rng.integers(0, 256, (len(st.k_pages), 3, st.page_bytes), dtype=np.uint8) for _ in range(2))
    runner.write_pages([5, 6, 9], HostReady(data))
    log = runner.device.log
    log.clear()
    back = runner.read_pages([5, 6, 9])
    mark = log[0][1]
    copies = 2 * 2 * len(st.k_pages)              # K and V per layer, for the runs [5, 6] and [9]
    assert log[:2] == [("record", mark, compute), ("wait", copy, mark)]
    assert [(kind, stream) for kind, stream, _ in log[2:2 + copies]] == [("dtoh", copy)] * copies
    # The lane writes on into its tail page and an evicted page is reused: C waits for K.
    assert log[2 + copies:] == [("record", id(back.done.handle), copy), ("wait", compute, id(back.done.handle))]
    runner.write_pages([12, 11, 10], back)        # in flight: ordered on K, no host wait
    assert not [entry for entry in log if entry[0] in ("sync", "event_sync")]
    for a, b in zip(runner.read_pages([10, 11, 12]).wait(), data):
        np.testing.assert_array_equal(a, b[:, [2, 1, 0]])


def test_without_pinned_memory_copies_still_round_trip_and_hold_the_compute_stream(tiny_dense_path):
    runner = make_runner(tiny_dense_path, 0)
    try:
        compute, copy = streams(runner)
        assert runner.copies.pool is None and runner.copies.staging is None
        fill_slot(runner, 1, seed=5)
        expected = slot_bytes(runner, 1)
        saved = runner.save_slot(1)
        log = runner.device.log
        # Straight from the slot (no staging slot), so C waits for K before it may change it.
        assert ("dtod", compute) not in [(e[0], e[1]) for e in log]
        assert log[-1] == ("wait", compute, id(saved.done.handle))
        assert b"".join(a.tobytes() for a in saved.wait()) == expected
    finally:
        runner.close()


def test_a_copy_from_a_file_is_checked_before_anything_is_queued(runner):
    st = runner.storage
    log = runner.device.log
    log.clear()
    bad = HostReady((np.zeros((len(st.states), 8), np.uint8), np.zeros((len(st.windows), 8), np.uint8)))
    with pytest.raises(ValueError, match="does not match"):
        runner.load_slot(0, bad)
    with pytest.raises(ValueError, match="does not fit 2 pages"):
        runner.write_pages([1, 2], runner.read_pages([1]))
    assert not [entry for entry in log if entry[0] == "htod"]


def test_the_pinned_pool_gives_pieces_back_when_the_last_view_is_gone():
    from runtime.model.gpu.host_copies import ALIGN, PinnedPool

    freed = []
    device = NullDevice()
    buffer = device.pinned(4 * ALIGN)
    buffer.free = lambda: freed.append(True)
    pool = PinnedPool(buffer)
    a, b, c = pool.take(ALIGN), pool.take(ALIGN + 1), pool.take(ALIGN)   # b takes two units
    assert [x.ctypes.data - buffer.ptr for x in (a, b, c)] == [0, ALIGN, 3 * ALIGN]
    assert pool.take(1) is None                                     # full
    view = b[:8].view(np.uint32)
    del b
    assert pool.take(2 * ALIGN) is None                             # a view still holds b's piece
    del view, a                                                     # a and b free: one run of 3
    merged = pool.take(3 * ALIGN)
    assert merged is not None and merged.ctypes.data == buffer.ptr
    pool.close()
    assert not freed                                                # pieces are still viewed
    del merged
    assert not freed
    del c
    assert freed == [True]


def test_the_engine_demotes_snapshots_without_waiting_for_them(tiny_dense_path):
    """Every snapshot of a prompt goes to the host tier (no device snapshot slots). Each copy
    runs on K, the host never waits for one, and C waits for one only right before the next
    copy into the staging slot, never before a step's compute."""
    from runtime.engine.api import EngineRequest, SamplingParams
    from runtime.engine.engine_loop import Engine, EngineConfig

    runner = make_runner(tiny_dense_path, 0)          # the engine reserves the pinned pool itself
    try:
        compute, copy = streams(runner)
        config = EngineConfig(num_lanes=1, max_context=512, prefill_chunk=64, snapshot_interval=64,
                              prefix_cache=True, snapshot_slots=0, host_cache_bytes=8 << 20)
        prompt = tuple(np.random.default_rng(6).integers(1, 200, 200).tolist())
        with Engine(runner, config, on_thread_start=runner.device.make_current) as engine:
            list(engine.submit(EngineRequest("a", prompt, SamplingParams(greedy=True), 4)))
            stats = engine.cache.scheduler.cache.cache.stats
            assert stats["snapshots"] == 3                     # at 64, 128 and 192
            assert engine.cache.traffic.device_to_host_bytes == 3 * runner.slot_nbytes
        log = runner.device.log
        staging = runner.copies.staging
        assert runner.copies.pool is not None and staging is not None
        outs = [i for i, entry in enumerate(log) if entry[0] == "dtoh" and entry[1] == copy]
        assert [log[i][2] for i in outs] == [staging] * 3
        done = {log[i + 1][1] for i in outs}
        assert all(log[i + 1] == ("record", log[i + 1][1], copy) for i in outs)
        assert not [e for e in log if e == ("sync", copy) or (e[0] == "event_sync" and e[1] in done)]
        for i, entry in enumerate(log):
            if entry[0] == "wait" and entry[1] == compute and entry[2] in done:
                assert log[i + 1] == ("dtod", compute, staging), log[i - 3:i + 3]
    finally:
        runner.close()
