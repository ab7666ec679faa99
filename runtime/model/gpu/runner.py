"""`CudaRunner`: the `ModelRunner` protocol on one NVIDIA GPU, with AOT-compiled CuTe DSL kernels.

The runner checks each call, maps the engine's slots to physical ones (`storage.StateSlots`) and
hands the work to its parts: `storage` (the arenas), `weights` (layout, upload), `kernels`
(which variant runs what), `layers` (the forward pass as bound launches), `step` (metadata,
plans, graphs, look-ahead) and `sampling` (device sampling).

`step(rows)` (the step contract of `runtime/model/runner.py`) runs, in this order: the one-token
rows without snapshots as decode batches of up to `max_batch` (graphs per bucket, as `decode`);
each prefill row as `prefill` does, with only the wanted positions' logits computed; then the
verification rows as verification steps (`Steps.verify`, `layers.StepShape`): all positions of
rows of one length in one step, the projections as decode GEMV blocks, the recurrent layers as
one launch each that computes the positions in order with the decode kernels' arithmetic,
position 0 reading the row's own slot and every position writing its state to its snapshot.
Decode kernels are batch-invariant, so every row equals the separate calls it stands for bit
for bit. `commit(slot, snapshot)` swaps the two slots' physical storage (no copy), so
the snapshot slot then holds the slot's old state.

With an MTP head (`mtp=True`, `gpu.mtp`): after every prefill piece, decode row (a step computed
ahead included, once used) and verification row, the final-normed hidden rows are copied from the
workspace to the slot's kept rows (`_keep`), keyed by the engine slot (so `commit`'s swap of
physical slots does not move them); `mtp_draft` runs the head from them.

With a vision tower (`vision_component`, `gpu.vision_rows`): a prefill piece's image and video
pads take the tower's merged rows after the embedding, and every row of a sequence with media is
rotated at its MRoPE position; a runner without one launches exactly what it did before.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from runtime.model.config import ModelConfig
from runtime.model.kv_format import check_format
from runtime.model.gpu.kernels import KernelChoice
from runtime.model.gpu.host_copies import HostCopies
from runtime.model.gpu.layers import Forward
from runtime.model.gpu.mtp import MtpHead
from runtime.model.gpu.sampling import DeviceSampler
from runtime.model.gpu.slot_copies import SlotCopies
from runtime.model.gpu.step import Steps
from runtime.model.gpu.verify_rows import VerifyRows
from runtime.model.gpu.storage import BUCKETS, DECODE_MIN_SPLIT, Storage, StateSlots
from runtime.model.gpu.weights import FP8, NVFP4, WeightLayout, fill_synthetic, rope_tables, upload_artifact
from runtime.model.runner import (PAGE_SIZE, DecodeItem, MtpRow, PrefillChunk, StepRow,
                                  checked_draft_vocab, checked_page_table, checked_rows,
                                  checked_tokens, speculative_round_cost)
from runtime.model.sampling import RowSampling

# What each verified token adds to a decode step (`Steps.verify`: the GEMV is shared, the GDN
# conv and recurrent step are one `verify` launch each per layer, the head's rows are not
# shared). Measured on the H200 at the 27B shape, batch 1: 1 + 3 tokens cost 1.16 decode steps
# (0.053 a token), 1 + 7 tokens 1.32 (0.046) (docs/performance.md, "Verify kernels, the MTP
# head and MoE").
VERIFY_TOKEN_COST = 0.05


class CudaRunner(SlotCopies, VerifyRows):
    """See the module docstring. Build with `from_artifact` or `synthetic`.

    mtp: load the MTP head (its weights from `mtp_component`, the artifact's `mtp` component, or
    random with the synthetic seed); without it `mtp_layers` is 0 and no hidden rows are kept.
    mtp_draft_vocab: drafts over the lm_head's first N rows only (`ModelRunner.mtp_draft_vocab`);
    None: all of them. kv_dtype: the KV pages' format, bf16 or fp8 / int8 codes with per token-head
    scales (`runtime.model.kv_format`; `--kv-dtype`).

    Besides the protocol, tests and benchmarks read the parts: `config`, `device`, `stream`,
    `library`, `kernels` (`KernelChoice`), `layout` (`WeightLayout`), `storage`, `slots`, `steps`,
    `copies` (`HostCopies`: the host copies' stream, pinned pool and staging slot),
    and `read_state` (a GDN layer's state of a slot, in `NumpyRunner`'s layout).
    """

    def __init__(self, config: ModelConfig, *, num_pages: int, num_slots: int, component: Any = None,
                 synthetic_seed: int | None = None, device: Any = None, library: Any = None,
                 max_batch: int = 8, prefill_chunk: int = 512, max_context: int | None = None,
                 cuda_graphs: bool = True, decode_splits: int | None = None,
                 decode_min_split: int = DECODE_MIN_SPLIT, lookahead: bool = True,
                 progress: Callable[[int, int], None] | None = None,
                 weight_formats: Callable[[str], str] | None = None, mtp: bool = False,
                 mtp_component: Any = None, synthetic_router: str = "balanced", mtp_draft_vocab: int | None = None,
                 vision_component: Any = None, kv_dtype: str = "bf16"):
        from runtime.cuda.kernels import KernelLibrary

        if (component is None) == (synthetic_seed is None):
            raise ValueError("give exactly one of an artifact component or a synthetic seed")
        if component is not None and mtp != (mtp_component is not None):
            raise ValueError("an artifact runner loads the MTP head from the artifact's mtp component: give "
                             "mtp_component exactly when mtp is True")
        if max_batch not in BUCKETS:
            raise ValueError(f"max_batch must be one of {BUCKETS}, got {max_batch}")
        c = self.config = config
        self.vocab_size = c.vocab_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        # `max_batch` spares hold a decode step computed ahead (see `decode_sampled`).
        self.slots = StateSlots(num_slots, max_batch if lookahead else 0)
        self.max_context = min(max_context or num_pages * PAGE_SIZE, c.max_position_embeddings)
        if device is None:
            from runtime.cuda.device import CudaDevice
            device = CudaDevice(0)
        self.device = device
        self.stream = device.create_stream()
        self.library = library or KernelLibrary.open(device, required=[])
        # Projection formats: the artifact's; for synthetic weights `weight_formats` (default bf16,
        # `weights.fp8_recipe_format` / `nvfp4_recipe_format` for an FP8 / NVFP4 model). Planned
        # first: a model the runner cannot run yet is refused by name before its kernels are looked for.
        self.layout = WeightLayout.plan(c, (lambda name: component.entry(name).format) if component is not None
                                        else weight_formats, mtp=mtp)
        self.kv_dtype = check_format(kv_dtype)
        self.kernels = KernelChoice(self.library, c, expert_format=self.layout.expert_format, kv_dtype=self.kv_dtype)
        for fam, key in self.kernels.required():
            self.library.kernel(fam, key)
        for fmt in (FP8, NVFP4):  # a missing shape is refused before the upload, naming it
            for n, nt, k in sorted(self.layout.quantized_shapes(fmt)):
                self.kernels.linear_quantised(fmt, n, nt, k)
        # The quantised linears with prefill kernels compiled (`KernelChoice.quantised_prefill`)
        # share scratch sized for the largest: FP8 the widest input's quantised rows, NVFP4 the
        # largest weight decoded to bf16.
        prefill = {fmt: [(n, k) for n, nt, k in self.layout.quantized_shapes(fmt)
                         if self.kernels.quantised_prefill(fmt, n, nt, k)] for fmt in (FP8, NVFP4)}
        self._component = component
        self._host_embed: np.ndarray | None = None
        self.storage = Storage(c, device, self.kernels, weight_bytes=self.layout.total, num_pages=num_pages,
                               phys_slots=self.slots.phys_slots, max_batch=max_batch, prefill_chunk=prefill_chunk,
                               max_context=self.max_context, decode_splits=decode_splits,
                               decode_min_split=decode_min_split, kv_dtype=self.kv_dtype,
                               mtp_layers=len(self.layout.mtp_layers), media=vision_component is not None,
                               fp8_k=max((k for _, k in prefill[FP8]), default=0),
                               nvfp4_weights=max((n * k for n, k in prefill[NVFP4]), default=0))
        st = self.storage
        if component is not None:
            upload_artifact(self.layout, component, device, st.weights_base, self.stream, progress, mtp_component)
        else:
            fill_synthetic(self.layout, int(synthetic_seed), device, st.weights_base, self.stream,
                           router=synthetic_router)
        cos, sin = rope_tables(c, st.rope_positions)
        device.memcpy_htod(st.buf["cos"], cos, self.stream)
        device.memcpy_htod(st.buf["sin"], sin, self.stream)
        self.stream.synchronize()
        for n in range(num_slots):
            self.reset_slot(n)
        forward = Forward(c, self.kernels, self.library, st, self.layout, self.slots.phys_slots)
        self.steps = Steps(device, self.stream, st, self.slots, forward, self.kernels, self._embed_table,
                           cuda_graphs=cuda_graphs)
        self.sampler = DeviceSampler(device, self.stream, st, self.kernels, self.library, self.steps.plans,
                                     c.vocab_size)
        self._ahead = None  # the decode step queued ahead (`step.Ahead`), if any
        self.lookahead_steps = {True: 0, False: 0}  # steps computed ahead: used, dropped
        self.samples_on_device = bool(self.kernels.sample_candidates)
        self.copies = HostCopies(device, self.stream, st)
        self.mtp_layers = len(self.layout.mtp_layers)
        self.mtp_draft_vocab = checked_draft_vocab(mtp_draft_vocab, self.vocab_size)
        self._mtp = MtpHead(self, self.mtp_draft_vocab) if mtp else None
        # With a vision component, `vision_rows.MediaRows` (the GPU tower and the MRoPE rows);
        # without one, rows with media are refused.
        self._media = None
        if vision_component is not None:
            from runtime.model.gpu.vision import tower_from_component
            from runtime.model.gpu.vision_rows import MediaRows

            self._media = MediaRows(tower_from_component(vision_component, device, self.library, self.stream), c,
                                    st.rope_positions)

    @classmethod
    def from_artifact(cls, path_or_artifact: Any, mtp: bool = False, vision: bool = False,
                      **kwargs: Any) -> "CudaRunner":
        """mtp: load the artifact's `mtp` component as the MTP head; vision: its `vision`
        component as the tower (media rows: `vision_rows`)."""
        from runtime.artifact import open_artifact

        artifact = open_artifact(path_or_artifact) if not hasattr(path_or_artifact, "component") \
            else path_or_artifact
        text = artifact.component("text")
        runner = cls(ModelConfig.from_dict(text.config), component=text, mtp=mtp,
                     mtp_component=artifact.component("mtp") if mtp else None,
                     vision_component=artifact.component("vision") if vision else None, **kwargs)
        runner._artifact = artifact  # keeps the mapped file open for the host embedding rows
        return runner

    @classmethod
    def synthetic(cls, config: ModelConfig, seed: int, **kwargs: Any) -> "CudaRunner":
        return cls(config, synthetic_seed=seed, **kwargs)

    # ------------------------------------------------------------------ ModelRunner protocol

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        tokens, start, pages = self._checked_chunk(chunk.slot, chunk.token_ids, chunk.start_pos, chunk.page_table)
        self._checked_media(chunk.media)
        self._ahead = None
        wanted = range(len(tokens)) if chunk.all_logits else (len(tokens) - 1,)
        return self._prefill(chunk.slot, tokens, start, pages, wanted, media=chunk.media)

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        self._ahead = None
        return self._launch_decode(items)

    def step(self, rows: Sequence[StepRow]) -> list[np.ndarray]:
        checked_rows(rows, self.num_slots)
        checked = [self._checked_chunk(row.slot, row.token_ids, row.start_pos, row.page_table) for row in rows]
        for row in rows:
            self._checked_media(row.media)
            if row.media and row.snapshots is not None:
                raise ValueError("verification rows with media are not supported (--vision refuses "
                                 "speculative decoding)")
        self._ahead = None
        out: list[np.ndarray | None] = [None] * len(rows)
        decodes = [i for i, row in enumerate(rows) if row.num_tokens == 1 and row.snapshots is None]
        for lo in range(0, len(decodes), self.max_batch):
            group = decodes[lo:lo + self.max_batch]
            logits = self._launch_decode([DecodeItem(rows[i].slot, int(checked[i][0][0]), checked[i][1],
                                                     checked[i][2], media=rows[i].media) for i in group])
            for b, i in enumerate(group):
                out[i] = logits[b:b + 1] if rows[i].logit_offsets() else logits[:0]
        for i, row in enumerate(rows):
            if out[i] is None and row.snapshots is None:
                out[i] = self._prefill(row.slot, *checked[i], row.logit_offsets(), media=row.media)
        verify = [i for i, row in enumerate(rows) if row.snapshots is not None]
        if verify:
            for i, logits in zip(verify, self._verify([rows[i] for i in verify], [checked[i] for i in verify])):
                out[i] = logits
        return out  # type: ignore[return-value]

    def round_cost(self, drafts: int, mtp: bool) -> float:
        return speculative_round_cost(self.config, drafts, mtp, VERIFY_TOKEN_COST, self.mtp_draft_vocab)

    def commit(self, slot: int, snapshot: int) -> None:
        """Swap the physical slots behind `slot` and `snapshot` (see the module docstring)."""
        self.slots.check(slot)
        self.slots.check(snapshot)
        if slot == snapshot:
            raise ValueError(f"commit needs a snapshot slot other than the slot itself ({slot})")
        self._ahead = None
        self.slots.swap(slot, snapshot)

    def prefill_sampled(self, chunk: PrefillChunk, sampling: Callable[[], Sequence[RowSampling]]) -> np.ndarray:
        """Compute a chunk and sample the token after its last position on the device (as
        `decode_sampled` does for a decode row): int32 ids [1]."""
        if chunk.all_logits:
            raise ValueError("prefill_sampled samples the last position; all_logits asks for logits")
        tokens, start, pages = self._checked_chunk(chunk.slot, chunk.token_ids, chunk.start_pos, chunk.page_table)
        self._checked_media(chunk.media)
        self._ahead = None
        self._prefill(chunk.slot, tokens, start, pages, (), sample=True, media=chunk.media)
        rows = list(sampling())
        if len(rows) != 1:
            raise ValueError(f"sampling gave {len(rows)} rows for one prefill chunk")
        self.sampler.queue(rows).synchronize()
        return self.sampler.ids(1)

    def decode_sampled(self, items: Sequence[DecodeItem], sampling: Callable[[], Sequence[RowSampling]],
                       lookahead: bool = False) -> np.ndarray:
        """One token for each item, sampled on the device: int32 ids [len(items)] (`DEAD_END`
        where a row's mask allows nothing). `sampling()` gives each row's inputs; it is called
        once the forward pass is queued, so the host builds them while the GPU computes.

        lookahead: the caller expects to decode the same sequences again next, each with the
        token sampled here at the next position. The runner then queues that step's forward
        pass before returning (`step.Steps.launch_ahead`), so the GPU computes step t+1 while
        the host handles step t. The next call uses it if its items are exactly those (same
        slots in the same order, positions + 1, the sampled ids, the same pages) and discards it
        otherwise; a discarded step changed nothing but K/V rows at positions the real step
        rewrites before any query reads them."""
        ahead, self._ahead = self._ahead, None
        used = ahead is not None and ahead.matches(items)
        if ahead is not None:
            self.lookahead_steps[used] += 1
        if used:
            b = len(items)
            for logical, spare in zip(ahead.slots, ahead.spares):
                self.slots.adopt_spare(logical, spare)
            if self._mtp is not None:  # the hidden rows the step ahead left in `mtp_ahead`
                for i, (logical, pos) in enumerate(zip(ahead.slots, ahead.positions)):
                    self._keep(logical, pos, self.storage.buf["mtp_ahead"] + i * self._row_bytes, 1)
        else:
            b = self._queue_decode(items)
        rows = list(sampling())
        if len(rows) != b:
            raise ValueError(f"sampling gave {len(rows)} rows for {b} decode items")
        done = self.sampler.queue(rows)
        ahead = self.steps.launch_ahead(items, self._rope_shifts(items, 1)) if lookahead else None
        if ahead is not None and self._mtp is not None:  # its hidden rows, kept if the step is used
            self.device.memcpy_dtod(self.storage.buf["mtp_ahead"], self.storage.buf["h"], b * self._row_bytes,
                                    self.stream)
        done.synchronize()
        ids = self.sampler.ids(b)
        if ahead is not None:
            ahead.tokens = ids
            self._ahead = ahead
        return ids

    # ------------------------------------------------------------------ work

    def _checked_media(self, media: Sequence[Any]) -> None:
        if media and self._media is None:
            raise ValueError("media given but this runner has no vision tower (--vision)")

    def _rope_shifts(self, items: Sequence[DecodeItem], ahead: int = 0) -> list[int] | None:
        """Decode rows' rotary shifts (at their position + `ahead`); None for a runner without media."""
        if self._media is None:
            return None
        return [self._media.shift(int(item.pos) + ahead, item.media) for item in items]

    def _prefill(self, slot: int, tokens: np.ndarray, start: int, pages: np.ndarray, wanted: Sequence[int],
                 sample: bool = False, media: Sequence[Any] = ()) -> np.ndarray:
        """The chunk in pieces of at most `prefill_chunk` tokens, cut also where the prefill
        attention's first key split starts (`Storage.prefill_kv_split`: rows before it and past it
        take different kernels); float32 logits of the chunk offsets `wanted` [len(wanted), V]
        (sample: the last row left for the sampler); media: the sequence's media blocks."""
        outputs = []
        split = self.storage.prefill_kv_split - start
        cuts = sorted({*range(0, len(tokens), self.prefill_chunk), *([split] if 0 < split < len(tokens) else [])})
        for lo, hi in zip(cuts, cuts[1:] + [len(tokens)]):
            piece = tokens[lo:hi]
            last = lo + len(piece) == len(tokens)
            rows = [o - lo for o in wanted if lo <= o < lo + len(piece)]
            placed = self._media.piece(piece, start + lo, media) if self._media is not None else None
            outputs += self.steps.prefill_piece(self.slots.phys[slot], piece, start + lo, pages, rows,
                                                sample=sample and last, media=placed)
            self._keep(slot, start + lo, self.storage.buf["h"], len(piece), append=lo > 0)
        return np.concatenate(outputs, axis=0) if outputs else np.zeros((0, self.vocab_size), np.float32)

    def _launch_decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        return self.steps.read_logits(self._queue_decode(items))

    def _queue_decode(self, items: Sequence[DecodeItem]) -> int:
        """Check and queue the decode step of `items` (logits rows 0..b-1); b."""
        b = len(items)
        if b == 0:
            raise ValueError("decode needs at least one item")
        if b > self.max_batch:
            raise ValueError(f"decode batch of {b} exceeds max_batch {self.max_batch}")
        slots = [int(item.slot) for item in items]
        for s in slots:
            self.slots.check(s)
        if len(set(slots)) != b:
            raise ValueError(f"decode items must use distinct slots, got {slots}")
        tokens = checked_tokens([item.token_id for item in items], self.vocab_size)
        positions = [int(item.pos) for item in items]
        for pos in positions:
            if pos < 0 or pos >= self.max_context:
                raise ValueError(f"decode position {pos} outside [0, {self.max_context})")
        tables = [checked_page_table(item.page_table, pos + 1, self.num_pages) for item, pos in zip(items, positions)]
        phys = [self.slots.phys[s] for s in slots]
        self._checked_media([span for item in items for span in item.media])
        self.steps.decode(tokens, positions, tables, phys, phys, self._rope_shifts(items))
        for i, (s, pos) in enumerate(zip(slots, positions)):
            self._keep(s, pos, self.storage.buf["h"] + i * self._row_bytes, 1)
        return b

    # ------------------------------------------------------------------ the MTP head

    def mtp_draft(self, rows: Sequence[MtpRow]) -> list[list[int]]:
        """The protocol's MTP call (`gpu.mtp.MtpHead.draft`). The head's step overwrites the
        workspace and logits, so a decode step computed ahead is dropped."""
        if self._mtp is None:
            raise ValueError("this runner was built without an MTP head (mtp=False)")
        self._ahead = None
        return self._mtp.draft(rows)

    @property
    def _row_bytes(self) -> int:
        return self.config.hidden_size * 2

    def _keep(self, slot: int, start: int, src: int, count: int, src_pitch: int = 0, append: bool = False) -> None:
        """With an MTP head, keep `count` hidden rows at `src` as the slot's positions from `start`
        (`gpu.mtp.KeptHidden.keep`)."""
        if self._mtp is not None:
            self._mtp.kept.keep(int(slot), start, src, count, src_pitch, append)

    # ------------------------------------------------------------------ checks and reads

    def _checked_chunk(self, slot: int, token_ids: Sequence[int], start_pos: int, page_table: Sequence[int]
                       ) -> tuple[np.ndarray, int, np.ndarray]:
        """(tokens, start, pages) of a run of tokens, refusing a bad slot, tokens, start, a
        position past the context or a short page table."""
        tokens = checked_tokens(token_ids, self.vocab_size)
        self.slots.check(slot)
        if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative integer, got {start_pos!r}")
        start = int(start_pos)
        end = start + len(tokens)
        if end > self.max_context:
            raise ValueError(f"positions up to {end - 1} exceed this runner's context of {self.max_context}")
        return tokens, start, checked_page_table(page_table, end, self.num_pages)

    def _embed_table(self) -> np.ndarray:
        """The bf16 embedding table on the host, for shapes without an embedding kernel (the
        tiny test models): the artifact's mapped tensor, or a copy of the synthetic one."""
        if self._component is not None:
            return self._component.raw("embed_tokens.weight")
        if self._host_embed is None:
            slot = self.layout.globals["embed"]
            table = np.empty(slot.shape, np.uint16)
            self.device.memcpy_dtoh(table, self.storage.weights_base + slot.offset, self.stream)
            self.stream.synchronize()
            self._host_embed = table
        return self._host_embed

    def close(self) -> None:
        self.stream.synchronize()
        self.copies.close()
        if self._mtp is not None:
            self._mtp.close()
        self.steps.destroy_graphs()
        if self._media is not None:
            self._media.tower.close()
        self.storage.release()
