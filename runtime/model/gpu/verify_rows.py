"""The verification half of `CudaRunner`'s step contract: rows with snapshots as verification
steps (`Steps.verify`), their logits read back (`step`) or every position's next token sampled on
the device (`step_sampled`: only ids come back).

Why a device-sampled form: a verification step of 8 sequences x (1 + 3) tokens has 32 logits rows
of the full vocabulary; reading them back and sampling them on the host took ~8 ms of a 28 ms
round at the 27B shape on the H200 (the GPU's step was 20 ms), a third of what the draft tokens
save. Sampled on the device, the round reads 32 ids.

A mixin, so the protocol stays one object; it reads the runner's `slots`, `steps`, `storage`,
`sampler`, `max_batch`, `vocab_size`, `_row_bytes`, and calls its `_keep`, `_checked_chunk`,
`_queue_decode` and `_checked_media`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from runtime.model.runner import DecodeItem, StepRow, checked_rows
from runtime.model.sampling import RowSampling


class VerifyRows:
    slots: Any
    steps: Any
    storage: Any
    sampler: Any
    max_batch: int
    vocab_size: int
    num_slots: int
    _row_bytes: int
    _ahead: Any

    def step_sampled(self, rows: Sequence[StepRow],
                     sampling: Callable[[], Sequence[Sequence[RowSampling]]]) -> list[np.ndarray]:
        """The protocol's `step_sampled`: decode rows (one token, no snapshots) and verification
        rows, every position's next token sampled on the device from the inputs `sampling()`
        gives (one `RowSampling` per position of each row; called once the first forward pass
        is queued, so the host builds them while the GPU computes): int32 ids [num_tokens] per
        row. The forward passes are those `step` runs, so an id is the one the device sampler
        picks from the logits `step` would return."""
        checked_rows(rows, self.num_slots)
        for row in rows:
            if row.media:
                raise ValueError("step_sampled takes no rows with media")
            if row.snapshots is None and row.num_tokens != 1:
                raise ValueError("step_sampled takes decode and verification rows, not prefill rows")
            if row.logit_offsets() != tuple(range(row.num_tokens)):
                raise ValueError("step_sampled samples every position: its rows must want all logits")
        checked = [self._checked_chunk(row.slot, row.token_ids, row.start_pos, row.page_table) for row in rows]
        self._ahead = None
        inputs: list[list[RowSampling]] = []

        def row_inputs() -> list[list[RowSampling]]:
            if not inputs:
                inputs.extend(list(each) for each in sampling())
                if len(inputs) != len(rows) or any(len(x) != row.num_tokens for x, row in zip(inputs, rows)):
                    raise ValueError("sampling must give one RowSampling per position of each row")
            return inputs

        out: list[Optional[np.ndarray]] = [None] * len(rows)
        decodes = [i for i, row in enumerate(rows) if row.snapshots is None]
        for lo in range(0, len(decodes), self.max_batch):
            group = decodes[lo:lo + self.max_batch]
            self._queue_decode([DecodeItem(rows[i].slot, int(checked[i][0][0]), checked[i][1], checked[i][2])
                                for i in group])
            ids = self._sample_rows([row_inputs()[i][0] for i in group])
            for b, i in enumerate(group):
                out[i] = ids[b:b + 1]
        verify = [i for i, row in enumerate(rows) if row.snapshots is not None]
        if verify:
            picked = self._verify([rows[i] for i in verify], [checked[i] for i in verify],
                                  lambda: [row_inputs()[i] for i in verify])
            for i, ids in zip(verify, picked):
                out[i] = ids
        return out  # type: ignore[return-value]

    def _sample_rows(self, rows: Sequence[RowSampling]) -> np.ndarray:
        """Sample logits rows 0..len(rows)-1 on the device, `Storage.sample_rows` at a time;
        int32 ids [len(rows)]."""
        ids = []
        step = self.storage.sample_rows
        for row0 in range(0, len(rows), step):
            part = rows[row0:row0 + step]
            self.sampler.queue(part, row0).synchronize()
            ids.append(self.sampler.ids(len(part)))
        return np.concatenate(ids)

    def _verify(self, rows: Sequence[StepRow], checked: Sequence[tuple],
                sampled: Callable[[], Sequence[Sequence[RowSampling]]] | None = None) -> list[np.ndarray]:
        """Verification rows as verification steps (`Steps.verify`): rows of one length together,
        as many sequences per step as `Storage.verify_rows` and the batch allow (a row longer
        than a step takes goes in windows of positions, its snapshot chain carried across: a
        window reads the snapshot of the position before it, the row's slot for the first); the
        state after position p written to snapshot p. Without `sampled`: the wanted positions'
        logits per row, in order. With it (each row's inputs per position): every position's
        sampled id per row, int32 [num_tokens]."""
        phys = self.slots.phys
        wanted = [set(row.logit_offsets()) for row in rows]
        logits: list[dict[int, tuple[np.ndarray, int]]] = [{} for _ in rows]  # position -> (block, row)
        ids = [np.zeros(row.num_tokens, np.int32) for row in rows]
        by_length: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            by_length.setdefault(row.num_tokens, []).append(r)
        for t, members in sorted(by_length.items()):
            window = next(w for w in range(t, 0, -1) if self.steps.verify_fits(1, w))
            per_step = next(n for n in range(min(self.max_batch, len(members)), 0, -1)
                            if self.steps.verify_fits(n, window))
            for lo in range(0, len(members), per_step):
                group = members[lo:lo + per_step]
                for p0 in range(0, t, window):
                    span = range(p0, min(t, p0 + window))
                    self.steps.verify(
                        np.array([[checked[r][0][p] for p in span] for r in group], np.int64),
                        [checked[r][1] + p0 for r in group], [checked[r][2] for r in group],
                        [phys[rows[r].slot if p0 == 0 else rows[r].snapshots[p0 - 1]] for r in group],
                        [[phys[rows[r].snapshots[p]] for p in span] for r in group])
                    for b, r in enumerate(group):  # sequence b's rows are position-major, len(group) apart
                        self._keep(rows[r].slot, checked[r][1] + p0, self.storage.buf["h"] + b * self._row_bytes,
                                   len(span), src_pitch=len(group) * self._row_bytes, append=p0 > 0)
                    if sampled is not None:
                        inputs = sampled()
                        grid = self._sample_rows([inputs[r][p] for p in span for r in group])
                        grid = grid.reshape(len(span), len(group))
                        for b, r in enumerate(group):
                            ids[r][p0:p0 + len(span)] = grid[:, b]
                        continue
                    need = [(b, r, p) for b, r in enumerate(group) for p in span if p in wanted[r]]
                    if need:
                        blocks = self.steps.read_verify_logits(len(span), len(group))
                        for b, r, p in need:
                            logits[r][p] = (blocks[b], p - p0)
        if sampled is not None:
            return ids
        return [_in_order(by_pos, self.vocab_size) for by_pos in logits]


def _in_order(by_pos: dict[int, tuple[np.ndarray, int]], vocab: int) -> np.ndarray:
    """One verification row's wanted logits in position order: a view of its block where they are
    consecutive rows of one block (every position of one window: the usual case), else a copy."""
    if not by_pos:
        return np.zeros((0, vocab), np.float32)
    picks = [by_pos[p] for p in sorted(by_pos)]
    block, first = picks[0]
    if all(b is block and i == first + n for n, (b, i) in enumerate(picks)):
        return block[first:first + len(picks)]
    return np.stack([b[i] for b, i in picks])
