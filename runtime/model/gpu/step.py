"""Running steps on the device: metadata upload, plans, batch buckets, graphs, look-ahead.

A step (a prefill piece of one sequence, or a decode batch) is a list of launches bound once per
shape (`Plans`, `layers.Forward`). Per-step values live in the metadata block, uploaded with one
host-to-device copy before the launches, so decode for each batch bucket (1, 2, 4, 8) is captured
once into a CUDA graph and replayed; `cuda_graphs = False` launches the same list eagerly.
Logits come back as bf16, in blocks of `Storage.logit_rows` rows, and are returned as float32.

Decode rows read each GDN state and conv window at physical slot `slots_in[i]` and write it at
`slots[i]`: the same slot for a plain decode step, a spare for a step computed ahead (`Ahead`).
A verification step reads sequence b's at `slots_in[b]` and writes the state after each row at
`slots[row]`, the row's snapshot (`layers.StepShape`).

Look-ahead: after queueing step t's sampling, the runner queues step t+1 for the same sequences
(`launch_ahead`: ids copied on the device from the sampler's output, positions + 1, states
written to spare slots) before it waits for step t's ids, so the GPU runs t+1 while the engine
commits t and prepares its next call. If that call asks for exactly that step, its forward pass
is already done (the spares become the sequences' slots); otherwise it is dropped.

Prefill pieces are at most `prefill_chunk` tokens; GDN runs the chunked (WY, tensor-core) kernel
where one was compiled for the shape, else the recurrent `split` variant, either followed by the
gated norm as an `rmsnorm` gated_x launch (decode keeps the `fused` kernel); attention runs the
WGMMA `attention_wgmma` kernel where one was compiled for the shape, else the mma.sync
`attention_prefill` one, else each token is a query row of the split-KV kernel (see
docs/kernels.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from runtime.artifact.formats import bf16_to_f32
from runtime.model.gpu.layers import StepShape
from runtime.model.gpu.pdl import chain
from runtime.model.gpu.storage import BUCKETS, PREFILL_MIN_SPLIT, PREFILL_SPLITS
from runtime.model.runner import PAGE_SIZE, DecodeItem, checked_page_table

PREFILL_PLANS = 32  # bound shapes kept besides the decode buckets (prefill pieces, heads, sampling)


class Plans:
    """Bound launches per step shape, bound once. Decode plans stay (graphs replay their
    parameters); the other shapes are kept for the `PREFILL_PLANS` most recent."""

    def __init__(self) -> None:
        self.bound: OrderedDict[tuple, list] = OrderedDict()

    def get(self, key: tuple, bind: Callable[[], list]) -> list:
        plan = self.bound.get(key)
        if plan is None:
            plan = bind()
            self.bound[key] = plan
            others = [k for k in self.bound if k[0] != "decode"]
            if len(others) > PREFILL_PLANS:
                del self.bound[others[0]]
        else:
            self.bound.move_to_end(key)
        return plan

    def clear(self) -> None:
        """Forget every bound shape (after pointing `KernelChoice` at another variant)."""
        self.bound.clear()


@dataclass
class Ahead:
    """A decode step queued ahead (`CudaRunner.decode_sampled`): for the engine slots `slots`, in
    order, the tokens `tokens` at `positions` over the pages `tables`, states written to `spares`."""

    slots: list[int]
    positions: list[int]
    tables: list[np.ndarray]
    tokens: np.ndarray  # the ids sampled for these positions (set once they are on the host)
    spares: list[int]

    def matches(self, items: Sequence[DecodeItem]) -> bool:
        if len(items) != len(self.slots):
            return False
        for i, item in enumerate(items):
            if (int(item.slot) != self.slots[i] or int(item.pos) != self.positions[i]
                    or int(item.token_id) != int(self.tokens[i])):
                return False
            pages = np.asarray(item.page_table, dtype=np.int64).reshape(-1)[:len(self.tables[i])]
            if not np.array_equal(pages, self.tables[i]):
                return False
        return True


class Steps:
    """Queues prefill pieces and decode batches on one stream (see the module docstring)."""

    def __init__(self, device: Any, stream: Any, storage: Any, slots: Any, forward: Any, kernels: Any,
                 embed_table: Callable[[], np.ndarray], *, cuda_graphs: bool):
        self.device, self.stream, self.storage, self.slots = device, stream, storage, slots
        self.forward, self.kernels = forward, kernels
        self.embed_table = embed_table  # bf16 bits [V, H] on the host (no embedding kernel)
        self.cuda_graphs = cuda_graphs
        self.plans = Plans()
        self.graphs: dict[Any, Any] = {}  # decode bucket, or ("verify", nseq, t)
        self._meta_turn = 0
        # A runner with media: each row's rotary table row minus its KV position, for the next
        # metadata upload only (`shift_rope`; `vision_rows`).
        self._rope_shift = np.zeros(storage.rows, np.int32) if "rope_pos" in storage.meta_off else None

    # ------------------------------------------------------------------ decode

    def decode(self, tokens: np.ndarray, positions: Sequence[int], tables: Sequence[np.ndarray],
               slots_in: Sequence[int], slots_out: Sequence[int], shifts: Sequence[int] | None = None) -> None:
        """Queue one decode batch (checked by the caller; physical slots); its logits land in
        rows 0..b-1 of the logits buffer. shifts: the rows' rotary shifts (`shift_rope`)."""
        meta = self._meta_clear()
        bucket = self._decode_meta(meta, positions, tables, slots_in, slots_out)
        meta["ids"][:len(tokens)] = tokens
        if shifts is not None:
            self.shift_rope(shifts)
        self._upload_step(tokens, bucket)
        self._run_decode(bucket)

    def launch_ahead(self, items: Sequence[DecodeItem], shifts: Sequence[int] | None = None) -> Ahead | None:
        """Queue the decode step after `items` (see the module docstring); None where it cannot be
        computed ahead: no embedding kernel (ids are gathered on the host), too few spare slots,
        a position past the context, or a next position whose page the table does not hold yet."""
        st, slots = self.storage, self.slots
        b = len(items)
        if not self.kernels.embedding or b > len(slots.spares):
            return None
        positions = [int(item.pos) + 1 for item in items]
        tables = [np.asarray(item.page_table, dtype=np.int64).reshape(-1) for item in items]
        if any(p >= st.max_context or p // PAGE_SIZE >= len(t) for p, t in zip(positions, tables)):
            return None
        tables = [checked_page_table(t, p + 1, st.num_pages) for p, t in zip(positions, tables)]
        spares = slots.spares[:b]
        meta = self.meta_views(self._next_meta_block())
        bucket = self._decode_meta(meta, positions, tables, [slots.phys[int(item.slot)] for item in items], spares)
        if shifts is not None:
            self.shift_rope(shifts)
        self._upload_meta()
        self.device.memcpy_dtod(st.meta_ptr("ids"), st.buf["sample_ids"], b * 4, self.stream)
        self._run_decode(bucket)
        return Ahead(slots=[int(item.slot) for item in items], positions=positions, tables=tables,
                     tokens=np.zeros(0, np.int32), spares=spares)

    def verify(self, tokens: np.ndarray, positions: Sequence[int], tables: Sequence[np.ndarray],
               slots_in: Sequence[int], slots_out: Sequence[Sequence[int]]) -> None:
        """Queue a verification step (checked by the caller; physical slots): nseq =
        len(positions) sequences of t tokens each, `tokens` [nseq, t]; sequence b's p-th token
        sits at positions[b] + p; sequence b's state is read at slots_in[b] and the state after
        its p-th token written at slots_out[b][p] (each position continues from the state the
        one before wrote). Logits land position-major: row p * nseq + b (`layers.StepShape`)."""
        nseq, t = tokens.shape
        shape = self._verify_shape(nseq, t)
        meta = self._meta_clear()
        self._fill_tables(meta, tables)
        meta["slots_in"][:nseq] = slots_in
        for p in range(t):
            for b in range(nseq):
                r, pos = p * nseq + b, positions[b] + p
                meta["pos"][r] = pos
                meta["wrow"][r] = kv_rows(tables[b], pos)
                meta["qseq"][r] = b
                meta["slots"][r] = slots_out[b][p]
        ids = tokens.T.reshape(-1)
        meta["ids"][:len(ids)] = ids
        self._upload_step(ids, len(ids))
        key = ("verify", nseq, t)
        if self.cuda_graphs:
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self.record(self.verify_plan(shape))
            graph.replay(self.stream)
        else:
            for launch in self.verify_plan(shape):
                launch(self.stream)

    def upload_rows(self, tokens: np.ndarray, positions: Sequence[int], seqs: Sequence[int],
                    tables: Sequence[np.ndarray], bucket: int) -> None:
        """Upload the metadata of a step of attention rows without GDN state (the MTP head,
        `gpu.mtp`): row r is token tokens[r] at positions[r] of sequence seqs[r], whose page table is
        tables[seqs[r]]; rows len(tokens)..bucket-1 are padding (token 0 at position 0 of the pad
        page, each its own sequence over a pad table row)."""
        meta = self._meta_clear()
        self.fill_rows(meta, tokens, positions, seqs, tables, bucket)
        self._upload_step(tokens, bucket)

    def fill_rows(self, meta: dict[str, np.ndarray], tokens: np.ndarray, positions: Sequence[int],
                  seqs: Sequence[int], tables: Sequence[np.ndarray], bucket: int) -> None:
        """`upload_rows`'s metadata written into `meta` (views of a zeroed block: `meta_views`)."""
        st = self.storage
        n = len(tokens)
        self._fill_tables(meta, tables)
        meta["ids"][:n] = tokens
        meta["pos"][:n] = positions
        meta["wrow"][:n] = [kv_rows(tables[s], p) for s, p in zip(seqs, positions)]
        meta["qseq"][:n] = seqs
        meta["wrow"][n:bucket] = st.num_pages * PAGE_SIZE
        meta["qseq"][n:bucket] = np.arange(len(tables), len(tables) + bucket - n)

    def verify_fits(self, nseq: int, t: int) -> bool:
        """Whether one verification step takes nseq sequences of t tokens (rows, logits, attention
        partials and a snapshot slot per row: `Storage.verify_rows`)."""
        st = self.storage
        return nseq <= st.max_batch and nseq * t <= st.verify_rows

    def _verify_shape(self, nseq: int, t: int) -> StepShape:
        st = self.storage
        return StepShape(m=nseq * t, nseq=nseq, t=t, splits=st.decode_splits, min_split=st.decode_min_split,
                         prefill=False)

    def verify_plan(self, shape: StepShape) -> list:
        return self.plans.get(("verify", shape.nseq, shape.t), lambda: self._chained(
            self.forward.bind(shape) + self.forward.lm_head(0, shape.m, exact_rows=True)))

    def decode_plan(self, bucket: int) -> list:
        st = self.storage
        shape = StepShape(m=bucket, nseq=bucket, t=1, splits=st.decode_splits, min_split=st.decode_min_split,
                          prefill=False)
        return self.plans.get(("decode", bucket),
                              lambda: self._chained(self.forward.bind(shape) + self.forward.lm_head(0, bucket)))

    def _chained(self, launches: list) -> list:
        """A decode or verification plan, with PDL launches when `KernelChoice.pdl` (`gpu.pdl`)."""
        return chain(launches) if self.kernels.pdl else launches

    def _decode_meta(self, meta: dict[str, np.ndarray], positions: Sequence[int], tables: Sequence[np.ndarray],
                     slots_in: Sequence[int], slots_out: Sequence[int]) -> int:
        """Fill a decode step's metadata (all but the ids): row i at `positions[i]` over the pages
        `tables[i]`, its GDN state and conv window read from physical slot `slots_in[i]` and
        written to `slots_out[i]`; the rows up to the batch bucket use the pad page and slot.
        Returns the bucket."""
        st = self.storage
        b = len(positions)
        bucket = next(x for x in BUCKETS if x >= b)
        self._fill_tables(meta, tables)
        for i, (pos, pages) in enumerate(zip(positions, tables)):
            meta["pos"][i] = pos
            meta["wrow"][i] = kv_rows(pages, pos)
        meta["wrow"][b:bucket] = st.num_pages * PAGE_SIZE
        meta["qseq"][:bucket] = np.arange(bucket)
        meta["slots_in"][:bucket] = self.slots.pad_slot
        meta["slots_in"][:b] = slots_in
        meta["slots"][:bucket] = self.slots.pad_slot
        meta["slots"][:b] = slots_out
        return bucket

    def _fill_tables(self, meta: dict[str, np.ndarray], tables: Sequence[np.ndarray]) -> None:
        """Page table row i = tables[i], the rest of every row the pad page."""
        st = self.storage
        table = meta["table"].reshape(st.max_batch, st.maxp)
        table[:] = st.num_pages
        for i, pages in enumerate(tables):
            table[i, :len(pages)] = pages

    def _run_decode(self, bucket: int) -> None:
        if self.cuda_graphs:
            graph = self.graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket)
            graph.replay(self.stream)
        else:
            for launch in self.decode_plan(bucket):
                launch(self.stream)

    def _capture(self, bucket: int) -> Any:
        graph = self.record(self.decode_plan(bucket))
        self.graphs[bucket] = graph
        return graph

    def record(self, plan: list) -> Any:
        """A CUDA graph of the launches of `plan`."""
        from runtime.cuda.device import capture_graph

        def record() -> None:
            for launch in plan:
                launch(self.stream)
        return capture_graph(self.device, self.stream, record)

    # ------------------------------------------------------------------ prefill

    def shift_rope(self, shifts: Sequence[int]) -> None:
        """Rows 0.. of the next step rotate at their KV position plus `shifts` (a runner with
        media: the sequence's MRoPE shift, `vision_rows`); consumed by that step's upload."""
        assert self._rope_shift is not None, "a runner without media has no rotary shifts"
        self._rope_shift[:len(shifts)] = shifts

    def prefill_piece(self, slot: int, tokens: np.ndarray, start: int, pages: np.ndarray, wanted: Sequence[int],
                      sample: bool = False, media: Any = None) -> list[np.ndarray]:
        """Queue one piece of at most `prefill_chunk` tokens of the sequence in physical slot
        `slot`; returns the float32 logits of the piece offsets `wanted` (increasing), in blocks.
        sample: leave the last row's logits in the logits buffer for the sampler instead.
        media: the piece's `vision_rows.PieceMedia` (rotary rows and merged media rows), or None."""
        st = self.storage
        t = len(tokens)
        end = start + t
        meta = self._meta_clear()
        positions = np.arange(start, end)
        meta["pos"][:t] = positions
        meta["wrow"][:t] = kv_rows(pages, positions)
        meta["ids"][:t] = tokens
        meta["slots"][0] = slot
        meta["slots_in"][0] = 0
        table = meta["table"].reshape(st.max_batch, st.maxp)
        table[0, :len(pages)] = pages
        # The conv kernel reads the old windows from a scratch copy (see layers.Forward.gdn).
        for n, window in enumerate(st.windows):
            self.device.memcpy_dtod(st.buf["win_scratch"] + n * st.win_slot_bytes,
                                    window + slot * st.win_slot_bytes, st.win_slot_bytes, self.stream)
        if media is not None:
            self.shift_rope(media.shift)
            if media.tables is not None:
                half_bytes = st.config.rotary_dim // 2 * 2
                for name, rows in zip(("cos", "sin"), media.tables):
                    self.device.memcpy_htod(st.buf[name] + st.rope_positions * half_bytes, rows, self.stream)
        self._upload_step(tokens, t)
        # From the first key split of the prefill attention on, its form over key splits (the
        # runner cuts pieces there, so a piece is wholly on one side: `Storage.prefill_kv_split`).
        if self.kernels.prefill_attn_split and start >= st.prefill_kv_split:
            shape = StepShape(m=t, nseq=1, t=t, splits=st.prefill_kv_splits, min_split=st.prefill_kv_split,
                              prefill=True, kv_split=True)
        else:
            shape = StepShape(m=t, nseq=1, t=t, splits=PREFILL_SPLITS, min_split=PREFILL_MIN_SPLIT, prefill=True)
        plan = self.plans.get(("prefill", t, shape.kv_split), lambda: self.forward.bind(shape))
        # The merged media rows replace the pads' token rows once the embedding is in the residual
        # (the first launch when the embedding kernel gathers them, else uploaded with the step).
        embedded = 1 if self.kernels.embedding else 0
        for launch in plan[:embedded]:
            launch(self.stream)
        for row0, rows in (media.embeddings if media is not None else ()):
            self.device.memcpy_htod(st.buf["resid"] + row0 * st.config.hidden_size * 2, rows, self.stream)
        for launch in plan[embedded:]:
            launch(self.stream)
        if sample:
            self._run_lm_head(t - 1, 1)
            return []
        out = []
        for lo, hi in consecutive_runs(wanted):
            for row0 in range(lo, hi, st.logit_rows):
                n = min(st.logit_rows, hi - row0)
                self._run_lm_head(row0, n)
                out.append(self.read_logits(n))
        return out

    def _run_lm_head(self, row0: int, rows: int) -> None:
        for launch in self.plans.get(("lm_head", row0, rows), lambda: self.forward.lm_head(row0, rows)):
            launch(self.stream)

    # ------------------------------------------------------------------ host <-> device

    def read_logits(self, rows: int, width: int | None = None) -> np.ndarray:
        """Logits rows 0..rows-1 as float32 [rows, V] (waits for the stream); width: rows of
        that many ids instead (the MTP drafts' `mtp_draft_vocab`)."""
        v = width or self.storage.config.vocab_size
        return bf16_to_f32(self._logits_bits(rows * v).reshape(rows, v))

    def read_verify_logits(self, positions: int, nseq: int) -> list[np.ndarray]:
        """A verification step's logits rows (position-major: row p * nseq + b, `layers.StepShape`)
        as float32 [positions, V] per sequence, each written once: 32 rows of the 27B's vocabulary
        are 32 MB, and a conversion, a copy and a restack of them cost the host more than the
        GPU's whole step at batch 8 (`bench.mtp_round`)."""
        v = self.storage.config.vocab_size
        grid = self._logits_bits(positions * nseq * v).reshape(positions, nseq, v)
        return [bf16_to_f32(grid[:, b]) for b in range(nseq)]

    def _logits_bits(self, count: int) -> np.ndarray:
        """The first `count` bf16 logits as raw bits in the pinned staging buffer (waits for the
        stream; valid until the next read)."""
        st = self.storage
        host = st.logits_host.array(np.uint16, count)
        self.device.memcpy_dtoh(host, st.buf["logits"], self.stream)
        self.stream.synchronize()
        return host

    def _next_meta_block(self) -> np.ndarray:
        """The other pinned metadata block, zeroed (the one the last upload read stays intact)."""
        st = self.storage
        self._meta_turn ^= 1
        arr = st.meta_hosts[self._meta_turn].array(np.int32, st.meta_count)
        arr[:] = 0
        return arr

    def meta_views(self, arr: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of one metadata block `arr` (int32 [meta_count]) by name."""
        st = self.storage
        return {name: arr[off:off + st.meta_size[name]] for name, off in st.meta_off.items()}

    def _meta_clear(self) -> dict[str, np.ndarray]:
        self.stream.synchronize()  # earlier uploads may still read the pinned blocks
        return self.meta_views(self._next_meta_block())

    def _upload_meta(self) -> None:
        """Upload the metadata block filled last (with media, its rotary rows: `shift_rope`)."""
        st = self.storage
        if self._rope_shift is not None:
            meta = self.meta_views(st.meta_hosts[self._meta_turn].array(np.int32, st.meta_count))
            meta["rope_pos"][:] = meta["pos"] + self._rope_shift
            self._rope_shift[:] = 0
        self.device.memcpy_htod(st.buf["meta"], st.meta_hosts[self._meta_turn].array(np.int32, st.meta_count),
                                self.stream)

    def _upload_step(self, tokens: np.ndarray, rows: int) -> None:
        self._upload_meta()
        if not self.kernels.embedding:
            st = self.storage
            host = st.embed_host.array(np.uint16, rows * st.config.hidden_size).reshape(rows, -1)
            host[:len(tokens)] = self.embed_table()[tokens]
            host[len(tokens):] = 0
            self.device.memcpy_htod(st.buf["resid"], host, self.stream)

    def destroy_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()
        self.plans.clear()


def kv_rows(pages: np.ndarray, positions: Any) -> Any:
    """The KV pool rows of `positions` (an int or an array) in a sequence with page table `pages`."""
    return pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE


def consecutive_runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """`values`, in order, as maximal runs [lo, hi) of values that each follow the one before
    by 1 (offsets of wanted logits rows; page ids of a host copy)."""
    runs: list[list[int]] = []
    for o in values:
        if runs and runs[-1][1] == o:
            runs[-1][1] = o + 1
        else:
            runs.append([o, o + 1])
    return [(lo, hi) for lo, hi in runs]

