"""The slot and host-copy half of `CudaRunner`'s `ModelRunner` protocol: zeroing and copying
recurrent-state slots, the sizes of a slot's and a page's host copies, and the copies themselves
(`host_copies.HostCopies` on the copy stream), each checked and mapped from engine slots to
physical ones (`storage.StateSlots`). A mixin, so the protocol stays one object; it reads the
runner's `config`, `device`, `stream`, `storage`, `slots`, `copies` and `num_pages`, and drops a
step computed ahead (`_ahead`) whenever it changes what that step read.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from runtime.artifact.formats import bf16_to_f32
from runtime.model.gpu.step import consecutive_runs
from runtime.model.runner import HostTransfer, checked_pages


class SlotCopies:
    config: Any
    device: Any
    stream: Any
    storage: Any
    slots: Any
    copies: Any
    num_pages: int
    _ahead: Any

    def reset_slot(self, slot: int) -> None:
        self.slots.check(slot)
        self._ahead = None
        st, phys = self.storage, self.slots.phys[slot]
        for state, window in zip(st.states, st.windows):
            self.device.memset_d8(state + phys * st.state_slot_bytes, 0, st.state_slot_bytes, self.stream)
            self.device.memset_d8(window + phys * st.win_slot_bytes, 0, st.win_slot_bytes, self.stream)

    def copy_slot(self, src: int, dst: int) -> None:
        self.slots.check(src)
        self.slots.check(dst)
        self._ahead = None
        st = self.storage
        src, dst = self.slots.phys[src], self.slots.phys[dst]
        for state, window in zip(st.states, st.windows):
            self.device.memcpy_dtod(state + dst * st.state_slot_bytes, state + src * st.state_slot_bytes,
                                    st.state_slot_bytes, self.stream)
            self.device.memcpy_dtod(window + dst * st.win_slot_bytes, window + src * st.win_slot_bytes,
                                    st.win_slot_bytes, self.stream)

    @property
    def device_bytes(self) -> int:
        return sum(arena.capacity for arena in self.storage.arenas.arenas.values())

    @property
    def slot_nbytes(self) -> int:
        st = self.storage
        return len(st.states) * (st.state_slot_bytes + st.win_slot_bytes)

    @property
    def page_nbytes(self) -> int:
        return 2 * len(self.storage.k_pages) * self.storage.page_bytes

    def reserve_host_copies(self, nbytes: int) -> int:
        return self.copies.reserve(nbytes)

    def host_buffer(self, nbytes: int) -> Optional[np.ndarray]:
        return self.copies.pool.take(nbytes) if self.copies.pool is not None else None

    def save_slot(self, slot: int) -> HostTransfer:
        """The slot's GDN states and conv windows as raw bytes, one row per GDN layer, copied on
        the copy stream (`host_copies`)."""
        self.slots.check(slot)
        return self.copies.save_slot(self.slots.phys[slot])

    def load_slot(self, slot: int, state: HostTransfer) -> None:
        self.slots.check(slot)
        self.copies.load_slot(self.slots.phys[slot], state)
        self._ahead = None

    def read_pages(self, pages: Sequence[int]) -> HostTransfer:
        """K and V rows of `pages` as raw bytes [attention layers, pages, page bytes]; runs of
        consecutive page ids go in one copy per layer."""
        ids = checked_pages(pages, self.num_pages)
        return self.copies.read_pages(self._page_runs(ids), len(ids))

    def write_pages(self, pages: Sequence[int], data: HostTransfer) -> None:
        ids = checked_pages(pages, self.num_pages)
        self.copies.write_pages(self._page_runs(ids), len(ids), data)
        self._ahead = None

    def _page_runs(self, ids: np.ndarray) -> list[tuple[slice, int]]:
        """(rows of the host copy, byte offset in each layer's K or V pool) of every run of
        consecutive page ids, so each run is one copy per layer."""
        runs, at = [], 0
        for first, end in consecutive_runs(ids.tolist()):
            runs.append((slice(at, at + end - first), first * self.storage.page_bytes))
            at += end - first
        return runs

    def read_state(self, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(recurrent state [Hv, dk, dv] fp32, conv window [Kc-1, conv_dim] fp32) of the n-th GDN
        layer, in `NumpyRunner`'s layout (tests)."""
        c, st = self.config, self.storage
        state = np.empty((c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim), np.float32)
        win = np.empty((c.linear_conv_kernel_dim - 1, c.conv_dim), np.uint16)
        self.stream.synchronize()
        phys = self.slots.phys[slot]
        self.device.memcpy_dtoh(state, st.states[layer] + phys * st.state_slot_bytes, self.stream)
        self.device.memcpy_dtoh(win, st.windows[layer] + phys * st.win_slot_bytes, self.stream)
        self.stream.synchronize()
        return np.swapaxes(state, 1, 2).copy(), bf16_to_f32(win)
