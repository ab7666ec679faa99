"""Device sampling of `CudaRunner`: the `sampling` kernels over rows of the logits buffer.

The rows' inputs (`runtime.model.sampling.RowSampling`: parameters, packed mask, penalty list)
go up in one pinned block, the candidates kernel reduces each row's slices to top candidates per
CTA, the pick kernel draws each row's id, and only the ids come back (`Storage.sample_host["ids"]`).
The decisions are those of `runtime.model.sampling.decide` (the host sampler's), see there.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from runtime.model.sampling import ROW_F32, ROW_I32, RowSampling, fill_row


class DeviceSampler:
    """Queues the sampling of logits rows 0..len(rows)-1 (`queue`) and hands back the ids (`ids`)."""

    def __init__(self, device: Any, stream: Any, storage: Any, kernels: Any, library: Any, plans: Any,
                 vocab_size: int):
        self.device, self.stream, self.storage = device, stream, storage
        self.kernels, self.library, self.plans = kernels, library, plans
        self.vocab_size = vocab_size
        self.ids_ready = device.create_event()

    def queue(self, rows: Sequence[RowSampling], row0: int = 0) -> Any:
        """Upload the rows' inputs, queue both kernels over logits rows row0.. and the ids'
        download; returns the event that marks the ids on the host."""
        st, s = self.storage, self.stream
        b = len(rows)
        self.upload(rows)
        for launch in self.plan(b, row0=row0):
            launch(s)
        self.device.memcpy_dtoh(st.sample_host["ids"][:b], st.buf["sample_ids"], s)
        self.ids_ready.record(s)
        return self.ids_ready

    def upload(self, rows: Sequence[RowSampling]) -> None:
        """Queue the upload of the rows' inputs (rows 0..len(rows)-1 of the device block)."""
        st = self.storage
        v, words = self.vocab_size, st.mask_words
        host = st.sample_host
        if len(rows) > st.sample_rows:
            raise ValueError(f"{len(rows)} rows to sample exceed the {st.sample_rows} one sampling takes")
        row_i32 = host["row_i32"].reshape(st.sample_rows, ROW_I32)
        row_f32 = host["row_f32"].reshape(st.sample_rows, ROW_F32)
        masks = host["bitmask"].reshape(st.sample_rows, words)
        pen = 0
        for r, row in enumerate(rows):
            n = len(row.penalty_ids)
            if pen + n > st.max_penalties:
                raise ValueError(f"{pen + n} penalised ids in one step exceed the {st.max_penalties} reserved")
            if n and (row.penalty_ids.min() < 0 or row.penalty_ids.max() >= v):
                raise ValueError(f"penalised ids must be in [0, {v})")
            host["pen_ids"][pen:pen + n] = row.penalty_ids
            host["pen_delta"][pen:pen + n] = row.penalty_deltas
            if row.bitmask is not None:
                if row.bitmask.shape != (words,):
                    raise ValueError(f"bitmask of row {r} has shape {row.bitmask.shape}, not ({words},)")
                masks[r] = row.bitmask.view(np.uint32)
            pen += fill_row(row, row_i32[r], row_f32[r], pen)
        dev, s, off, base = self.device, self.stream, st.sample_off, st.buf["sample_in"]
        for name in ("row_i32", "row_f32", "bitmask"):
            dev.memcpy_htod(base + off[name], host[name], s)
        if pen:
            dev.memcpy_htod(base + off["pen_ids"], host["pen_ids"][:pen], s)
            dev.memcpy_htod(base + off["pen_delta"], host["pen_delta"][:pen], s)

    def plan(self, rows: int, vocab: int | None = None, row0: int = 0) -> list:
        """The two kernels over logits rows row0..row0+rows-1 of `vocab` ids each (default the
        model's: the MTP drafts' rows are `mtp_draft_vocab` wide), ids into `buf["sample_ids"]`
        (its first `rows` entries)."""
        vocab = vocab or self.vocab_size
        return self.plans.get(("sample", rows, vocab, row0), lambda: self._bind(rows, vocab, row0))

    def ids(self, b: int) -> np.ndarray:
        """The ids of the last `queue` (after its event): int32 [b]."""
        return self.storage.sample_host["ids"][:b].copy()

    def _bind(self, rows: int, vocab: int, row0: int) -> list:
        k, lib, buf, off = self.kernels, self.library, self.storage.buf, self.storage.sample_off
        inputs = {name: buf["sample_in"] + off[name] for name in ("row_i32", "row_f32", "bitmask", "pen_ids",
                                                                 "pen_delta")}
        cands = {"cand_val": buf["cand_val"], "cand_id": buf["cand_id"]}
        return [
            lib.kernel("sampling", k.sample_candidates).bind(
                {"logits": buf["logits"] + row0 * vocab * 2, "bitmask": inputs["bitmask"], "row_i32": inputs["row_i32"],
                 "pen_ids": inputs["pen_ids"], "pen_delta": inputs["pen_delta"], **cands},
                {"R": rows, "V": vocab}),
            lib.kernel("sampling", k.sample_pick).bind(
                {**cands, "row_i32": inputs["row_i32"], "row_f32": inputs["row_f32"], "ids": buf["sample_ids"]},
                {"R": rows}),
        ]
