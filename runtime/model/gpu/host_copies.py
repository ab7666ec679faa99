"""The CUDA runner's host copies (`save_slot`, `load_slot`, `read_pages`, `write_pages` of the
`ModelRunner` protocol): pinned host memory and a copy stream, so that no copy makes the host
wait and a slot's copy to the host overlaps the steps after it.

Memory: `reserve(nbytes)` (the prefix cache's host budget, `--host-context-mib`) pins one host
allocation, handed out in pieces (first fit; a freed piece merges with its free neighbours),
and takes one device staging slot. A piece is free again once the last array viewing it is
gone: the arrays keep it alive, so no later copy can reuse memory someone still reads. A copy
that finds no piece (before `reserve`, or when the file and disk tiers' short-lived copies
come on top of a full host tier) goes to pageable memory: correct, but the driver then makes
the host wait for it.

Order, with the compute stream C and the copy stream K (`docs/prefix_cache.md`):
- a slot out: C copies the slot into the staging slot (device to device, a fraction of a
  millisecond), then records an event; K waits for it, copies the staging slot to the host and
  records the copy's own event (`PinnedCopy`). C goes on at once: the lane can compute its next
  chunk and the slot can take another state while K copies. Only the next slot out waits, on
  C, for the staging slot to be read. Without a staging slot, C waits for K's copy instead.
- pages out (one page, ~4 MB at the 27B shape): K copies them after an event on C, and C waits
  for K before its later work (the lane goes on writing the page, an evicted page is reused).
- in (slot or pages): K waits for an event on C (earlier work on the destination is done),
  copies (after any copy out on K it reads from: same stream), and C waits for K's event
  before the step that reads the destination.
The host waits only in `PinnedCopy.wait` (the file and disk tiers read the bytes themselves).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from runtime.cuda.device import Event
from runtime.cuda.errors import CudaError
from runtime.model.runner import HostArrays, HostTransfer

ALIGN = 256  # pieces start 256-byte aligned (as device buffers do)


class PinnedPool:
    """One pinned host allocation handed out in pieces (see the module docstring).

    A piece comes back from a finalizer, which may run inside any allocation (the cyclic
    collector), `take` included: it only appends to `_returned`, and `take` merges what came
    back before it looks for room."""

    def __init__(self, buffer: Any):
        self._buffer = buffer
        self._free: list[tuple[int, int]] = [(0, buffer.nbytes)]  # (offset, size), by offset
        self._returned: list[tuple[int, int]] = []
        self._taken = 0
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    def contains(self, array: np.ndarray) -> bool:
        start = array.ctypes.data
        return self._buffer.ptr <= start and start + array.nbytes <= self._buffer.ptr + self._buffer.nbytes

    def take(self, nbytes: int) -> Optional[np.ndarray]:
        """A uint8 array of `nbytes` in pinned memory, or None when no free piece is that large."""
        self._merge_returned()
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        found = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
        if found is None:
            return None
        offset, free = self._free[found]
        self._free[found:found + 1] = [(offset + size, free - size)] if free > size else []
        self._taken += 1
        raw = (ctypes.c_uint8 * nbytes).from_address(self._buffer.ptr + offset)
        weakref.finalize(raw, self._give, offset, size).atexit = False
        return np.frombuffer(raw, np.uint8)

    def _give(self, offset: int, size: int) -> None:
        self._returned.append((offset, size))
        if self._closed:
            self._merge_returned()

    def _merge_returned(self) -> None:
        while self._returned:
            offset, size = self._returned.pop()
            self._taken -= 1
            at = next((i for i, (o, _) in enumerate(self._free) if o > offset), len(self._free))
            self._free.insert(at, (offset, size))
            if at + 1 < len(self._free) and offset + size == self._free[at + 1][0]:
                self._free[at:at + 2] = [(offset, size + self._free[at + 1][1])]
            if at > 0 and self._free[at - 1][0] + self._free[at - 1][1] == offset:
                self._free[at - 1:at + 1] = [(self._free[at - 1][0], self._free[at - 1][1] + self._free[at][1])]
        if self._closed and not self._taken:
            self._buffer.free()

    def close(self) -> None:
        """Free the allocation now, or when the last piece still viewed is given back."""
        self._closed = True
        self._merge_returned()


class PinnedCopy:
    """The CUDA runner's `HostTransfer`: host arrays a copy on the copy stream fills, complete
    when `done` (an event on that stream) is."""

    def __init__(self, arrays: HostArrays, done: Event):
        self.arrays = arrays
        self.done = done
        self.nbytes = sum(int(a.nbytes) for a in arrays)

    def ready(self) -> bool:
        return self.done.query()

    def wait(self) -> HostArrays:
        self.done.synchronize()
        return self.arrays


class HostCopies:
    """Host copies of slot states and KV pages of one runner (see the module docstring).

    storage: the runner's `Storage` (state, window and KV addresses and sizes); compute: the
    runner's stream.
    """

    def __init__(self, device: Any, compute: Any, storage: Any):
        self.device = device
        self.compute = compute
        self.stream = device.create_stream()
        self.storage = storage
        self.pool: Optional[PinnedPool] = None
        self.staging: Optional[int] = None     # device address of the staging slot
        self._staging_read: Optional[Event] = None  # K's copy that reads it last
        self._compute_mark = device.create_event(timing=False)
        self._copy_mark = device.create_event(timing=False)
        st = storage
        self.states_nbytes = len(st.states) * st.state_slot_bytes
        self.slot_nbytes = self.states_nbytes + len(st.windows) * st.win_slot_bytes

    def reserve(self, nbytes: int) -> int:
        """Pin `nbytes` of host memory and take the staging slot; the bytes pinned (0 when the
        driver refuses: every copy then goes through pageable memory). A runner pins once: a
        later call (another engine on the same runner) keeps the first pool."""
        if self.pool is not None:
            return min(nbytes, self.pool.nbytes)
        if nbytes <= 0:
            return 0
        try:
            self.pool = PinnedPool(self.device.pinned(nbytes))
        except CudaError:
            return 0
        try:
            self.staging = self.device.mem_alloc(self.slot_nbytes, "the host copies' staging slot")
        except CudaError:   # device memory is full: a slot copy out then holds up the compute stream
            self.staging = None
        return nbytes

    # --- out -------------------------------------------------------------------------------

    def save_slot(self, phys: int) -> PinnedCopy:
        """Copy physical slot `phys` (every GDN layer's state, then every window) to the host."""
        st = self.storage
        n = len(st.states)
        host = self._host(self.slot_nbytes)
        arrays = (host[:self.states_nbytes].reshape(n, st.state_slot_bytes),
                  host[self.states_nbytes:].reshape(n, st.win_slot_bytes))
        regions = [(s + phys * st.state_slot_bytes, st.state_slot_bytes) for s in st.states] + \
                  [(w + phys * st.win_slot_bytes, st.win_slot_bytes) for w in st.windows]
        if self.staging is None:
            pairs, at = [], 0
            for src, size in regions:
                pairs.append((host[at:at + size], src))
                at += size
            return self._download(arrays, pairs, hold_compute=True)
        if self._staging_read is not None:
            self.device.stream_wait_event(self.compute, self._staging_read)
        at = 0
        for src, size in regions:
            self.device.memcpy_dtod(self.staging + at, src, size, self.compute)
            at += size
        copy = self._download(arrays, [(host, self.staging)], hold_compute=False)
        self._staging_read = copy.done
        return copy

    def read_pages(self, runs: Sequence[tuple[slice, int]], count: int) -> PinnedCopy:
        """Copy K and V rows of pages to the host ([attention layers, count, page bytes] each);
        runs: (rows of the host copy, byte offset in each layer's pool) of consecutive pages."""
        st = self.storage
        shape = (len(st.k_pages), count, st.page_bytes)
        half = int(np.prod(shape))
        host = self._host(2 * half)
        keys, values = host[:half].reshape(shape), host[half:].reshape(shape)
        pairs = [(host_rows[n, rows], pool + offset)
                 for rows, offset in runs
                 for host_rows, pools in ((keys, st.k_pages), (values, st.v_pages))
                 for n, pool in enumerate(pools)]
        return self._download((keys, values), pairs, hold_compute=True)

    def _host(self, nbytes: int) -> np.ndarray:
        piece = self.pool.take(nbytes) if self.pool is not None else None
        return piece if piece is not None else np.empty(nbytes, np.uint8)

    def _download(self, arrays: HostArrays, pairs: list[tuple[np.ndarray, int]],
                  hold_compute: bool) -> PinnedCopy:
        """K copies each (host array, device address) pair after the work queued on C so far;
        hold_compute: C waits for the copy before its later work (the sources stay intact)."""
        self._compute_mark.record(self.compute)
        self.device.stream_wait_event(self.stream, self._compute_mark)
        for host, src in pairs:
            self.device.memcpy_dtoh(host, src, self.stream)
        done = self._event()
        done.record(self.stream)
        if hold_compute:
            self.device.stream_wait_event(self.compute, done)
        return PinnedCopy(arrays, done)

    # --- in --------------------------------------------------------------------------------

    def load_slot(self, phys: int, state: HostTransfer) -> None:
        st = self.storage
        states, windows = self.arrays(state)
        if states.shape != (len(st.states), st.state_slot_bytes) \
                or windows.shape != (len(st.windows), st.win_slot_bytes):
            raise ValueError("slot state does not match this runner's state shapes")
        self._upload([(s + phys * st.state_slot_bytes, states[n]) for n, s in enumerate(st.states)]
                     + [(w + phys * st.win_slot_bytes, windows[n]) for n, w in enumerate(st.windows)])

    def write_pages(self, runs: Sequence[tuple[slice, int]], count: int, data: HostTransfer) -> None:
        st = self.storage
        keys, values = self.arrays(data)
        if keys.shape != (len(st.k_pages), count, st.page_bytes) or values.shape != keys.shape:
            raise ValueError(f"page data of shape {keys.shape} does not fit {count} pages")
        self._upload([(pool + offset, host_rows[n, rows])
                      for rows, offset in runs
                      for host_rows, pools in ((keys, st.k_pages), (values, st.v_pages))
                      for n, pool in enumerate(pools)])

    @staticmethod
    def arrays(transfer: HostTransfer) -> HostArrays:
        """A transfer's arrays: this runner's own copies without waiting (a load is ordered
        after the copy on the copy stream), any other's (arrays read from a file) from `wait`."""
        return transfer.arrays if isinstance(transfer, PinnedCopy) else transfer.wait()

    def _upload(self, pairs: list[tuple[int, np.ndarray]]) -> None:
        self._compute_mark.record(self.compute)
        self.device.stream_wait_event(self.stream, self._compute_mark)
        for dst, host in pairs:
            self.device.memcpy_htod(dst, host, self.stream)
        self._copy_mark.record(self.stream)
        self.device.stream_wait_event(self.compute, self._copy_mark)

    # --- lifetime --------------------------------------------------------------------------

    def _event(self) -> Event:
        """An event destroyed once nothing holds it (a `PinnedCopy`, the staging slot's mark)."""
        event = self.device.create_event(timing=False)
        # Not at exit: the driver may be gone by then, and the process frees everything anyway.
        weakref.finalize(event, _destroy_event, self.device, Event(event.handle, self.device)).atexit = False
        return event

    def close(self) -> None:
        self.stream.synchronize()
        if self.staging is not None:
            self.device.mem_free(self.staging)
            self.staging = None
        if self.pool is not None:
            self.pool.close()
        self.device.destroy_event(self._compute_mark)
        self.device.destroy_event(self._copy_mark)
        self.device.destroy_stream(self.stream)


def _destroy_event(device: Any, event: Event) -> None:
    """Destroy an event from whichever thread let go of it last (the context made current
    there first: the engine thread and the server's main thread both hold copies)."""
    device.make_current()
    device.destroy_event(event)
