"""The MTP head's chained drafts on the device, with one read-back (`DraftChain`).

Drafts 2..k of a `mtp_draft` call run without a host round trip between them: each chained step's
metadata (positions, KV rows, page tables) is known before the first runs, since step s of a row
sits at start + m + s, so all of them are staged in one pinned block (`Storage.mtp_meta_host`) and
uploaded with one copy; the token each step reads is the draft the step before picked, which the
device sampler's greedy pick left in `buf["sample_ids"]`. The chain is then, per step s:

1. a device copy of staged block s into the metadata block the head's launches read;
2. a device copy of draft s + 1's ids (`buf["mtp_drafts"]` row s) into the block's token ids;
3. the head over `mtp_chain` (its own output of the step before), the lm_head over the draft
   vocabulary, the hidden output copied back to `mtp_chain` (`MtpHead.chain_plan`);
4. the greedy pick (`DeviceSampler.plan`) and its ids copied to `mtp_drafts` row s + 1.

All steps of a call are one captured graph per tuple of active row counts (rows are ordered by
their draft count, so the rows still drafting at step s are the first `active[s]`; the others are
left out of the step, and padding rows read token 0 from the staged block), replayed, and every
draft of every row comes back in one copy. A row's numbers are those of a one-step-at-a-time
chain: each step is the same plan of the same bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runtime.model.gpu.storage import BUCKETS
from runtime.model.runner import MTP_MAX_DRAFTS


@dataclass(frozen=True)
class DeviceCopy:
    """A device-to-device copy as a launch of a step's list (graph-capturable)."""

    device: Any
    dst: int
    src: int
    nbytes: int

    def __call__(self, stream: Any) -> None:
        self.device.memcpy_dtod(self.dst, self.src, self.nbytes, stream)


@dataclass(frozen=True)
class DeviceCopy2D:
    """A strided device copy as a launch of a step's list (graph-capturable)."""

    device: Any
    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    height: int

    def __call__(self, stream: Any) -> None:
        self.device.memcpy2d_dtod(self.dst, self.dst_pitch, self.src, self.src_pitch, self.width, self.height,
                                  stream)


@dataclass(frozen=True)
class ChainRow:
    """One drafting row of the chain: its first chained position (start + m), page table and
    number of chained steps (its drafts - 1)."""

    position: int
    table: np.ndarray
    steps: int


class DraftChain:
    """Stages, runs and reads back the chained drafts of the head `head` (`MtpHead`)."""

    def __init__(self, head: Any):
        self.head = head
        self.device, self.stream, self.storage = head.device, head.stream, head.storage
        self.steps = head.steps
        self.graphs: dict[tuple[int, ...], Any] = {}  # active rows per step -> graph

    def first_ids(self, row0: int, rows: int) -> None:
        """Queue the copy of the greedy ids of logits rows 0..rows-1 (just picked) as draft 1 of
        drafting rows row0 .. row0 + rows - 1."""
        st = self.storage
        self.device.memcpy_dtod(st.buf["mtp_drafts"] + row0 * 4, st.buf["sample_ids"], rows * 4, self.stream)

    def run(self, rows: Sequence[ChainRow]) -> np.ndarray:
        """Queue the chain over `rows` (in drafting order, draft 1 of each already in row 0 of
        `mtp_drafts`), wait, and return the drafts: int32 [MTP_MAX_DRAFTS, len(rows)], row j the
        draft j + 1 of each row (rows past a row's count are unspecified)."""
        st, n = self.storage, len(rows)
        active = tuple(sum(1 for row in rows if row.steps > s) for s in range(max((r.steps for r in rows), default=0)))
        if active:
            self._stage(rows, active)
            if self.steps.cuda_graphs:
                graph = self.graphs.get(active)
                if graph is None:
                    graph = self.graphs[active] = self.steps.record(self.plan(active))
                graph.replay(self.stream)
            else:
                for launch in self.plan(active):
                    launch(self.stream)
        host = st.mtp_drafts_host.array(np.int32, MTP_MAX_DRAFTS * st.max_batch)
        self.device.memcpy_dtoh(host, st.buf["mtp_drafts"], self.stream)
        self.stream.synchronize()
        return host.reshape(MTP_MAX_DRAFTS, st.max_batch)[:, :n].copy()

    def _stage(self, rows: Sequence[ChainRow], active: Sequence[int]) -> None:
        """Fill and upload the metadata block of every chained step: step s has the first
        active[s] rows at their position + s, padded to their bucket."""
        st = self.storage
        # No wait here: the last `run` waited for its stream, so no upload reads the pinned block.
        staged = st.mtp_meta_host.array(np.int32, (MTP_MAX_DRAFTS - 1) * st.meta_count)
        staged[:len(active) * st.meta_count] = 0
        for s, count in enumerate(active):
            meta = self.steps.meta_views(staged[s * st.meta_count:(s + 1) * st.meta_count])
            bucket = next(b for b in BUCKETS if b >= count)
            self.steps.fill_rows(meta, np.zeros(count, np.int64), [row.position + s for row in rows[:count]],
                                 range(count), [row.table for row in rows[:count]], bucket)
        self.device.memcpy_htod(st.buf["mtp_meta"], staged[:len(active) * st.meta_count], self.stream)

    def plan(self, active: Sequence[int]) -> list:
        """The launches of a chain whose step s has active[s] rows (see the module docstring)."""
        st, dev = self.storage, self.device
        block = st.meta_count * 4
        drafts = st.buf["mtp_drafts"]
        out: list = []
        for s, count in enumerate(active):
            bucket = next(b for b in BUCKETS if b >= count)
            out.append(DeviceCopy(dev, st.buf["meta"], st.buf["mtp_meta"] + s * block, block))
            out.append(DeviceCopy(dev, st.meta_ptr("ids"), drafts + s * st.max_batch * 4, count * 4))
            out += self.head.chain_plan(bucket)
            out += self.head.greedy_plan(count)
            out.append(DeviceCopy(dev, drafts + (s + 1) * st.max_batch * 4, st.buf["sample_ids"], count * 4))
        return out

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()
