"""The MTP head on the GPU (qwen-arch 2.6): the kept hidden rows per slot and `mtp_draft`.

`KeptHidden` holds, per engine slot, the final-normed hidden rows (after the model's `norm`, as
`NumpyRunner` keeps them) of the slot's latest prefill chunk, decode row or verification row; the
runner copies them out of `buf["h"]` after each step (`CudaRunner._keep`).

`MtpHead.draft` is `ModelRunner.mtp_draft` (the contract of `MtpRow` and `numpy_mtp.MtpDrafter`):
1. catch-up: every row's positions start .. start + m - 1 in one step of m rows per sequence
   (several steps when they exceed the workspace rows or `max_batch` sequences), the head's KV rows
   written there; each drafting row's last position is put first, so the head's hidden outputs
   and logits of rows 0..n-1 are those the drafts start from;
2. draft 1 of each row is the greedy id of its last catch-up position (the device sampler's
   greedy pick, lowest id on ties), left on the device;
3. drafts 2..k chain the head on its own output: one decode-shaped step per draft over the rows
   still drafting (a prefix, since rows are ordered by their draft count), its hidden output
   copied to `mtp_chain` for the next step, each step's token the draft before it picked on the
   device; all steps one captured graph and every draft read back at once (`mtp_chain.DraftChain`).
   Where ids cannot be picked or embedded on the device (no sampling or embedding kernel), each
   draft is the argmax of its logits read back and fed to the next step from the host, one graph
   per batch bucket per step.

Every greedy pick is over the draft vocabulary (`--mtp-draft-vocab`): the lm_head's first `vocab`
rows only, so a draft reads vocab x H of the head's weights instead of all of them.

The head's forward pass (`MtpHead.bind`) reuses the main model's launches: the embedding, the two
pre-fc norms writing the two halves of each [embedding | hidden] row (the norms write rows of H, two
strided copies interleave them), fc (2H -> H) as the residual, then one gated-attention layer over
its own KV pool (`Storage.k_pages[n_attn + j]`, same page tables), its MLP, `mtp.norm`, and the
lm_head over the rows that draft. The MLP is the model's kind: dense, or MoE through the main
layers' `Forward.moe_mlp` (the 35B-A3B's head: 256 experts, top 8, a shared expert), whose form
follows the row count: the decode form for the chained drafts (at most `MOE_DECODE_ROWS` rows), the
grouped prefill GEMMs for a catch-up over more rows (its shape is not `exact`, like its
projections' GEMM), with the same routing and per-row sums.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from runtime.model.config import MOE_MLP
from runtime.model.gpu.layers import StepShape
from runtime.model.gpu.mtp_chain import ChainRow, DeviceCopy, DeviceCopy2D, DraftChain
from runtime.model.gpu.storage import BUCKETS, PREFILL_MIN_SPLIT, PREFILL_SPLITS
from runtime.model.runner import MTP_MAX_DRAFTS, MtpRow, checked_page_table, checked_tokens
from runtime.model.sampling import RowSampling


class KeptHidden:
    """Per engine slot, the hidden rows of its latest computation and their first position, in one
    of `entries` device blocks of `rows` rows of `row_bytes` (`Storage.buf["mtp_kept"]`). Lanes are
    at most `max_batch` = `entries`, so each computing slot keeps its block; a slot new to the head
    takes a free block or the least recently kept one."""

    def __init__(self, device: Any, stream: Any, base: int, entries: int, rows: int, row_bytes: int):
        self.device, self.stream = device, stream
        self.base, self.entries, self.rows, self.row_bytes = base, entries, rows, row_bytes
        self._held: OrderedDict[int, list[int]] = OrderedDict()  # slot -> [entry, first position, count]

    def keep(self, slot: int, start: int, src: int, count: int, src_pitch: int = 0, append: bool = False) -> None:
        """Queue the copy of `count` hidden rows at `src` (`src_pitch` bytes apart, contiguous by
        default) as the slot's positions start .. start + count - 1. append: add them after the
        rows kept for the slot when those end at `start` and the block has room (the next piece of
        one computation); otherwise they replace them (the last `rows` rows where there are more)."""
        pitch = src_pitch or self.row_bytes
        held = self._held.get(slot)
        if append and held is not None and held[1] + held[2] == start and held[2] + count <= self.rows:
            first = held[2]
            held[2] += count
        else:
            if count > self.rows:
                src, start, count = src + (count - self.rows) * pitch, start + count - self.rows, self.rows
            entry = held[0] if held is not None else self._free_entry()
            held = self._held[slot] = [entry, start, count]
            first = 0
        self._held.move_to_end(slot)
        dst = self.base + (held[0] * self.rows + first) * self.row_bytes
        self.device.memcpy2d_dtod(dst, self.row_bytes, src, pitch, self.row_bytes, count, self.stream)

    def find(self, slot: int) -> tuple[int, int, int] | None:
        """(first position, row count, device address of the first row) kept for the slot."""
        held = self._held.get(slot)
        if held is None:
            return None
        return held[1], held[2], self.base + held[0] * self.rows * self.row_bytes

    def _free_entry(self) -> int:
        used = {held[0] for held in self._held.values()}
        free = [e for e in range(self.entries) if e not in used]
        if free:
            return free[0]
        _, (entry, _, _) = self._held.popitem(last=False)
        return entry


class MtpHead:
    """The runner's MTP head: `kept` (the hidden rows per slot) and `draft` (see the module
    docstring). Built by `CudaRunner` with an MTP layout; `layer` is the MTP layer that drafts
    (0, as `NumpyRunner`); `vocab` the draft vocabulary (`mtp_draft_vocab`): the lm_head's first
    `vocab` rows, a view of the same weight."""

    def __init__(self, runner: Any, vocab: int, layer: int = 0):
        self.runner = runner
        self.device, self.stream, self.storage = runner.device, runner.stream, runner.storage
        self.steps, self.forward, self.sampler = runner.steps, runner.steps.forward, runner.sampler
        self.layer = layer
        st, h = self.storage, runner.config.hidden_size
        self.row_bytes = h * 2
        self.kept = KeptHidden(self.device, self.stream, st.buf["mtp_kept"], st.max_batch, st.rows, self.row_bytes)
        self.graphs: dict[int, Any] = {}  # chained steps per batch bucket (the host-side chain)
        self.vocab = vocab
        full = self.forward.layout.globals.get("lm_head") or self.forward.layout.globals["embed"]
        # Rows are contiguous, so the first `vocab` rows are the weight's first vocab * H values.
        self.head = full if vocab == full.shape[0] else replace(full, shape=(vocab, h))
        # A missing GEMV for the draft rows is refused at start, naming the shape.
        if self.head.format == "bf16":
            runner.kernels.linear(vocab, h, 8)
        else:
            runner.kernels.linear_quantised(self.head.format, vocab, 0, h)
        # Drafts 2..k chained on the device (`mtp_chain`) where ids are picked and embedded there.
        self.chain = DraftChain(self) if runner.samples_on_device and runner.kernels.embedding else None

    # ------------------------------------------------------------------ drafting

    def draft(self, rows: Sequence[MtpRow]) -> list[list[int]]:
        checked = [self._checked(row) for row in rows]
        order = sorted(range(len(rows)), key=lambda i: -int(rows[i].num_drafts))
        drafting_order = [i for i in order if rows[i].num_drafts > 0]
        drafts: list[list[int]] = [[] for _ in rows]
        if self.chain is not None and drafting_order:
            self.sampler.upload([RowSampling(greedy=True)] * self.storage.max_batch)
        chained = 0  # rows of `mtp_chain` filled: the drafting rows so far, in `order`
        for group in self._groups(order, checked):
            drafting = [i for i in group if rows[i].num_drafts > 0]
            self._catch_up(group, drafting, checked)
            if drafting:
                st = self.storage
                self.device.memcpy_dtod(st.buf["mtp_chain"] + chained * self.row_bytes, st.buf["h"],
                                        len(drafting) * self.row_bytes, self.stream)
                if self.chain is not None:
                    for launch in self.greedy_plan(len(drafting)):
                        launch(self.stream)
                    self.chain.first_ids(chained, len(drafting))
                else:
                    for i, token in zip(drafting, self._host_greedy(len(drafting))):
                        drafts[i].append(int(token))
                chained += len(drafting)
        if self.chain is not None:
            if drafting_order:
                ids = self.chain.run([ChainRow(checked[i][1] + len(checked[i][0]), checked[i][2],
                                               int(rows[i].num_drafts) - 1) for i in drafting_order])
                for q, i in enumerate(drafting_order):
                    drafts[i] = [int(t) for t in ids[:rows[i].num_drafts, q]]
            return drafts
        most = max((int(row.num_drafts) for row in rows), default=0)
        for j in range(1, most):
            active = [i for i in order if rows[i].num_drafts > j]
            tokens = np.array([drafts[i][-1] for i in active], np.int64)
            # Draft j + 1 reads the head's output at start + m + j - 1 and draft j (the token there + 1).
            positions = [checked[i][1] + len(checked[i][0]) + j - 1 for i in active]
            self._chain_step(tokens, positions, [checked[i][2] for i in active])
            for i, token in zip(active, self._host_greedy(len(active))):
                drafts[i].append(int(token))
        return drafts

    def _checked(self, row: MtpRow) -> tuple[np.ndarray, int, np.ndarray, int]:
        """(tokens, start, pages, kept rows' address) of a row, checked as `MtpDrafter.draft`
        checks it, before anything is written."""
        r = self.runner
        tokens = checked_tokens(row.token_ids, r.vocab_size)
        r.slots.check(row.slot)
        kept = self.kept.find(int(row.slot))
        if kept is None:
            raise ValueError(f"slot {row.slot} has no kept hidden states to draft from")
        start, count, address = kept
        if start != row.start_pos or len(tokens) > count:
            raise ValueError(f"MTP row at {row.start_pos} with {len(tokens)} tokens does not match slot "
                             f"{row.slot}'s kept positions {start}..{start + count - 1}")
        if isinstance(row.num_drafts, bool) or not 0 <= row.num_drafts <= MTP_MAX_DRAFTS:
            raise ValueError(f"num_drafts must be in 0..{MTP_MAX_DRAFTS}, got {row.num_drafts}")
        end = start + len(tokens) + max(int(row.num_drafts) - 1, 0)
        if end > r.max_context:
            raise ValueError(f"MTP positions up to {end - 1} exceed this runner's context of {r.max_context}")
        return tokens, start, checked_page_table(row.page_table, end, r.num_pages), address

    def _groups(self, order: Sequence[int], checked: Sequence[tuple]) -> list[list[int]]:
        """Consecutive runs of `order` that fit one catch-up step (workspace rows, table rows)."""
        st = self.storage
        groups: list[list[int]] = []
        rows = 0
        for i in order:
            m = len(checked[i][0])
            if not groups or rows + m > st.rows or len(groups[-1]) == st.max_batch:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += m
        return groups

    def _catch_up(self, group: Sequence[int], drafting: Sequence[int], checked: Sequence[tuple]) -> None:
        """One step over every position of the group's rows: row q's last position is step row q,
        its others follow all the last positions. The hidden rows it reads go to `mtp_in` first."""
        st, rb = self.storage, self.row_bytes
        tokens, positions, seqs = [0] * len(group), [0] * len(group), list(range(len(group)))
        at = len(group)
        for q, i in enumerate(group):
            ids, start, _, kept = checked[i]
            m = len(ids)
            tokens[q], positions[q] = int(ids[-1]), start + m - 1
            self.device.memcpy_dtod(st.buf["mtp_in"] + q * rb, kept + (m - 1) * rb, rb, self.stream)
            if m > 1:
                self.device.memcpy_dtod(st.buf["mtp_in"] + at * rb, kept, (m - 1) * rb, self.stream)
                tokens += [int(t) for t in ids[:-1]]
                positions += range(start, start + m - 1)
                seqs += [q] * (m - 1)
                at += m - 1
        self.steps.upload_rows(np.array(tokens, np.int64), positions, seqs, [checked[i][2] for i in group], at)
        # The projections by row count (a GEMM over a prompt chunk's rows, where GEMV blocks would
        # read every weight once per 8 rows); the lm_head rows, at most `max_batch`, as decode's.
        shape = StepShape(m=at, nseq=len(group), t=1, splits=PREFILL_SPLITS, min_split=PREFILL_MIN_SPLIT,
                          prefill=False, exact=False)
        heads = len(drafting)
        key = ("mtp", at, len(group), heads, self.vocab)
        for launch in self.steps.plans.get(key, lambda: self.bind(shape, st.buf["mtp_in"]) + (
                self.lm_head(heads) if heads else [])):
            launch(self.stream)

    def _chain_step(self, tokens: np.ndarray, positions: Sequence[int], tables: Sequence[np.ndarray]) -> None:
        """One chained draft for len(tokens) rows (the first rows of `mtp_chain`), padded to a
        bucket, with the ids from the host (where `DraftChain` cannot run)."""
        n = len(tokens)
        bucket = next(b for b in BUCKETS if b >= n)
        self.steps.upload_rows(tokens, positions, range(n), tables, bucket)
        plan = self.chain_plan(bucket)
        if not self.steps.cuda_graphs:
            for launch in plan:
                launch(self.stream)
            return
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self.steps.record(plan)
        graph.replay(self.stream)

    def chain_plan(self, bucket: int) -> list:
        """A chained step of `bucket` rows: the head over `mtp_chain`, the lm_head, and the hidden
        output copied back to `mtp_chain` for the next draft."""
        st = self.storage
        shape = StepShape(m=bucket, nseq=bucket, t=1, splits=st.decode_splits, min_split=st.decode_min_split,
                          prefill=False)
        return self.steps.plans.get(("mtp_chain", bucket, self.vocab), lambda: (
            self.bind(shape, st.buf["mtp_chain"]) + self.lm_head(bucket)
            + [DeviceCopy(self.device, st.buf["mtp_chain"], st.buf["h"], bucket * self.row_bytes)]))

    def lm_head(self, rows: int) -> list:
        """The head's lm_head over the draft vocabulary: hidden rows 0..rows-1 into logits rows of
        `vocab` ids, in decode GEMV blocks (a row's numbers do not depend on the row count)."""
        out: list = []
        buf = self.storage.buf
        self.forward.linear(out, buf["h"], self.head, buf["logits"], rows, exact_rows=True)
        return out

    def greedy_plan(self, rows: int) -> list:
        """The device sampler's greedy pick over logits rows 0..rows-1 of the draft vocabulary
        (its rows' inputs uploaded by `draft`), ids into `buf["sample_ids"]`."""
        return self.sampler.plan(rows, self.vocab)

    def _host_greedy(self, n: int) -> np.ndarray:
        """The greedy ids of logits rows 0..n-1 (lowest id on ties) on the host."""
        return np.argmax(self.steps.read_logits(n, self.vocab), axis=1)

    # ------------------------------------------------------------------ the forward pass

    def bind(self, shape: StepShape, hidden: int) -> list:
        """The head's launches for `shape.m` rows: token ids from the metadata, hidden rows at
        `hidden`; its final-normed output in `buf["h"]` (the lm_head's input)."""
        f, buf, lay = self.forward, self.storage.buf, self.forward.layout
        k, rb, m = f.kernels, self.row_bytes, shape.m
        out: list = []
        f.embedding(out, shape)
        f.launch(out, "rmsnorm", k.norm, {"x": buf["resid"], "w": f.w(lay.mtp["pre_fc_norm_embedding"]),
                                          "out": buf["delta"]}, {"M": m})
        f.launch(out, "rmsnorm", k.norm, {"x": hidden, "w": f.w(lay.mtp["pre_fc_norm_hidden"]), "out": buf["h"]},
                 {"M": m})
        out.append(DeviceCopy2D(self.device, buf["mtp_x"], 2 * rb, buf["delta"], rb, rb, m))
        out.append(DeviceCopy2D(self.device, buf["mtp_x"] + rb, 2 * rb, buf["h"], rb, rb, m))
        f.linear(out, buf["mtp_x"], lay.mtp["fc"], buf["resid"], m, exact_rows=shape.exact_rows)
        layer = lay.mtp_layers[self.layer]
        f.norm(out, shape, layer["input_norm"])
        f.attention(out, shape, len(self.runner.config.attention_layers) + self.layer, layer)
        f.add_norm(out, shape, layer["post_norm"])
        if self.runner.config.mtp_mlp_type == MOE_MLP:
            f.moe_mlp(out, shape, layer)
        else:
            f.dense_mlp(out, shape, layer)
        f.add_norm(out, shape, lay.mtp["norm"])
        return out

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.destroy()
        self.graphs.clear()
        if self.chain is not None:
            self.chain.close()
