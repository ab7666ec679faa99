"""`CudaRunner`: the `ModelRunner` protocol on one NVIDIA GPU, with AOT-compiled CuTe DSL kernels.

Storage (all reserved once at construction, `runtime.cuda.memory.DeviceArenas`):
- weights: bf16 as stored in the artifact, uploaded once with no repacking (`cuda_weights`);
- KV pages: per full-attention layer, K and V `[(num_pages + 1) * 64, Hkv, D]` bf16, post-norm and
  post-RoPE (the paging contract of `runner.py`); page `num_pages` is a pad page that padded
  decode rows write into;
- state slots: per GDN layer the fp32 recurrent state `[phys_slots, Hv, dv, dk]` (v-major) and
  the conv window `[phys_slots, Kc - 1, conv_dim]` bf16. The engine's `num_slots` slots map onto
  physical ones (`_phys`); `max_batch` spares receive the states of a decode step computed
  ahead, and the last physical slot is the pad slot that padded decode rows use;
- workspace: activations for up to `max(prefill_chunk, max_batch)` rows, attention split
  partials, the logits rows, RoPE tables and one int32 metadata block.

A step (a prefill piece of one sequence, or a decode batch) is a list of launches bound once per
shape (`_bind_forward`). Per-step values (token ids, positions, KV rows, slots, page tables) live
in the metadata block, uploaded with one host-to-device copy before the launches, so decode for
each batch bucket (1, 2, 4, 8) is captured once into a CUDA graph and replayed; `cuda_graphs=False`
launches the same list eagerly. Logits come back as bf16 and are returned as float32.

Look-ahead (`decode_sampled(..., lookahead=True)`): after queueing step t's sampling, the runner
queues step t+1 for the same sequences (ids copied on the device from the sampler's output,
positions + 1, states written to spare slots) before it waits for step t's ids, so the GPU runs
t+1 while the engine commits t and prepares its next call. If that call asks for exactly that
step, its forward pass is already done (the spares become the sequences' slots); otherwise it is
dropped.

Prefill splits a chunk into pieces of at most `prefill_chunk` tokens. GDN runs the chunked (WY,
tensor-core) kernel over the piece where one was compiled for the shape, else the recurrent
`split` variant (each head's rows over several CTAs); either is followed by the gated norm as an
`rmsnorm` gated_x launch (decode keeps the `fused` kernel); attention runs the
tensor-core `attention_prefill` kernel (64-query tiles, gate fused) where one was compiled for the
shape, else it treats each token as a query row of the split-KV kernel (see docs/kernels.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from runtime.cuda.memory import DeviceArenas
from runtime.model.config import LINEAR_ATTENTION, ModelConfig
from runtime.model.cuda_plan import KernelChoice
from runtime.model.cuda_weights import WeightLayout, fill_synthetic, upload_artifact
from runtime.model.runner import (PAGE_SIZE, DecodeItem, PrefillChunk, checked_page_table,
                                  checked_tokens)
from runtime.model.sampling import ROW_F32, ROW_I32, TOP_K_CAP, RowSampling, fill_row

BUCKETS = (1, 2, 4, 8)
PREFILL_SPLITS = 16  # most KV splits per query row in prefill


@dataclass
class _Ahead:
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CudaRunner:
    """See the module docstring. Build with `from_artifact` or `synthetic`."""

    def __init__(self, config: ModelConfig, *, num_pages: int, num_slots: int, component: Any = None,
                 synthetic_seed: int | None = None, device: Any = None, library: Any = None,
                 max_batch: int = 8, prefill_chunk: int = 512, max_context: int | None = None,
                 cuda_graphs: bool = True, decode_split: int = 256, lookahead: bool = True,
                 progress: Callable[[int, int], None] | None = None):
        from runtime.cuda.kernels import KernelLibrary

        if (component is None) == (synthetic_seed is None):
            raise ValueError("give exactly one of an artifact component or a synthetic seed")
        if max_batch not in BUCKETS:
            raise ValueError(f"max_batch must be one of {BUCKETS}, got {max_batch}")
        c = config
        self.config = c
        self.vocab_size = c.vocab_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        # Physical state slots: the engine's slots map onto them (`_phys`); `max_batch` spares
        # hold a decode step computed ahead (see `decode_sampled`), the last one is the pad slot.
        spares = max_batch if lookahead else 0
        self.phys_slots = num_slots + spares + 1
        self.pad_slot = self.phys_slots - 1
        self._phys = list(range(num_slots))
        self._spares = list(range(num_slots, num_slots + spares))
        self._ahead: _Ahead | None = None
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.cuda_graphs = cuda_graphs
        self.max_context = min(max_context or num_pages * PAGE_SIZE, c.max_position_embeddings)
        self.maxp = _cdiv(self.max_context, PAGE_SIZE)
        self.decode_split = decode_split
        self.decode_splits = _cdiv(self.max_context, decode_split)
        if device is None:
            from runtime.cuda.device import CudaDevice
            device = CudaDevice(0)
        self.device = device
        self.stream = device.create_stream()
        self.library = library or KernelLibrary.open(device, required=[])
        self.kernels = KernelChoice(self.library, c)
        for fam, key in self.kernels.required():
            self.library.kernel(fam, key)
        self.layout = WeightLayout.plan(c)
        self._component = component
        self._host_embed: np.ndarray | None = None

        self.rows = max(prefill_chunk, max_batch)
        self._reserve()
        base = self.arenas["weights"].base
        if component is not None:
            upload_artifact(self.layout, component, device, base, self.stream, progress)
        else:
            fill_synthetic(self.layout, int(synthetic_seed), device, base, self.stream)
        self._upload_rope()
        self.stream.synchronize()
        for n in range(num_slots):
            self.reset_slot(n)
        self._plans: OrderedDict[tuple, list] = OrderedDict()
        self._graphs: dict[int, Any] = {}
        self._ids_ready = device.create_event()
        self.lookahead_steps = {True: 0, False: 0}  # steps computed ahead: used, dropped
        self.samples_on_device = bool(self.kernels.sample_candidates)

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_artifact(cls, path_or_artifact: Any, **kwargs: Any) -> "CudaRunner":
        from runtime.artifact import open_artifact

        artifact = open_artifact(path_or_artifact) if not hasattr(path_or_artifact, "component") \
            else path_or_artifact
        text = artifact.component("text")
        runner = cls(ModelConfig.from_dict(text.config), component=text, **kwargs)
        runner._artifact = artifact  # the host embedding fallback reads the mapped table
        return runner

    @classmethod
    def synthetic(cls, config: ModelConfig, seed: int, **kwargs: Any) -> "CudaRunner":
        return cls(config, synthetic_seed=seed, **kwargs)

    def _reserve(self) -> None:
        c, dev = self.config, self.device
        h = c.hidden_size
        rows = self.rows
        n_gdn, n_attn = len(c.linear_layers), len(c.attention_layers)
        kv_bytes = (self.num_pages + 1) * PAGE_SIZE * c.num_key_value_heads * c.head_dim * 2
        state_bytes = self.phys_slots * c.linear_num_value_heads * c.linear_value_head_dim \
            * c.linear_key_head_dim * 4
        win_bytes = self.phys_slots * (c.linear_conv_kernel_dim - 1) * c.conv_dim * 2
        self.win_slot_bytes = (c.linear_conv_kernel_dim - 1) * c.conv_dim * 2
        self.state_slot_bytes = c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim * 4
        k = self.kernels
        proj_w = max(getattr(k, "gdn_stride", 0), getattr(k, "attn_stride", 0), 2 * (c.intermediate_size or 0))
        hq, d = c.num_attention_heads, c.head_dim
        part_rows = max(self.max_batch * self.decode_splits, rows * PREFILL_SPLITS) * hq
        self.rope_positions = min(c.max_position_embeddings, max(self.max_context, 1))
        self.logit_rows = rows if rows * c.vocab_size * 2 <= (256 << 20) else self.max_batch
        sizes = {
            "resid": rows * h * 2, "h": rows * h * 2, "delta": rows * h * 2, "proj": rows * proj_w * 2,
            "conv_out": rows * c.conv_dim * 2, "gdn_out": rows * c.linear_value_dim * 2,
            "q": rows * hq * d * 2, "attn_out": rows * hq * d * 2, "act": rows * (c.intermediate_size or 0) * 2,
            "o_part": part_rows * d * 4, "lse": part_rows * 4,
            "logits": self.logit_rows * c.vocab_size * 2,
            "cos": self.rope_positions * (c.rotary_dim // 2) * 2, "sin": self.rope_positions * (c.rotary_dim // 2) * 2,
            "win_scratch": max(n_gdn, 1) * self.win_slot_bytes,
        }
        # Device sampling: each row's inputs (parameters, packed mask, penalty list) in one block
        # mirrored by a pinned host block, the per-CTA candidates, the sampled ids.
        self.mask_words = _cdiv(c.vocab_size, 32)
        self.max_penalties = self.max_batch * min(self.max_context, c.vocab_size)
        sample_fields = (("row_i32", self.max_batch * ROW_I32, np.int32),
                         ("row_f32", self.max_batch * ROW_F32, np.float32),
                         ("bitmask", self.max_batch * self.mask_words, np.uint32),
                         ("pen_ids", self.max_penalties, np.int32), ("pen_delta", self.max_penalties, np.float32),
                         ("ids", self.max_batch, np.int32))
        self.sample_off = {}
        off = 0
        for name, count, _ in sample_fields:
            self.sample_off[name] = off
            off += _cdiv(count * 4, 256) * 256
        sample_bytes = off
        if k.sample_candidates:
            cands = self.max_batch * k.sample_ctas * TOP_K_CAP * 4
            sizes.update({"sample_in": sample_bytes, "cand_val": cands, "cand_id": cands, "sample_ids": self.max_batch * 4})
        # Metadata (int32): ids, pos, wrow, qseq [rows]; slots, slots_in [max_batch]; err; table.
        self.meta_size = {"ids": rows, "pos": rows, "wrow": rows, "qseq": rows, "slots": self.max_batch,
                          "slots_in": self.max_batch, "err": 4, "table": self.max_batch * self.maxp}
        self.meta_off = {}
        off = 0
        for name, count in self.meta_size.items():
            self.meta_off[name] = off
            off += _cdiv(count, 64) * 64
        self.meta_count = off
        sizes["meta"] = off * 4
        workspace = sum(_cdiv(v, 256) * 256 for v in sizes.values()) + 4096
        self.arenas = DeviceArenas.reserve(
            dev, weights=self.layout.total + 256, kv_pages=max(n_attn * 2 * kv_bytes, 256),
            state_slots=max(n_gdn * (state_bytes + win_bytes), 256), workspace=workspace)
        ws = self.arenas["workspace"]
        self.buf = {name: ws.take(max(n, 16), name).ptr for name, n in sizes.items()}
        kv = self.arenas["kv_pages"]
        self.k_pages = [kv.take(kv_bytes, f"k{i}").ptr for i in range(n_attn)]
        self.v_pages = [kv.take(kv_bytes, f"v{i}").ptr for i in range(n_attn)]
        st = self.arenas["state_slots"]
        self.states = [st.take(state_bytes, f"state{i}").ptr for i in range(n_gdn)]
        self.windows = [st.take(win_bytes, f"window{i}").ptr for i in range(n_gdn)]
        # Two pinned metadata blocks, used in turn: a step computed ahead is prepared in one while
        # the upload of the step before may still read the other.
        self.meta_hosts = [dev.pinned(self.meta_count * 4), dev.pinned(self.meta_count * 4)]
        self._meta_turn = 0
        self.logits_host = dev.pinned(self.logit_rows * c.vocab_size * 2)
        self.embed_host = dev.pinned(rows * h * 2)
        self.sample_pinned = dev.pinned(sample_bytes) if k.sample_candidates else None
        self.sample_host = {}
        if self.sample_pinned is not None:
            raw = self.sample_pinned.array(np.uint8)
            for name, count, dtype in sample_fields:
                start = self.sample_off[name]
                self.sample_host[name] = raw[start:start + count * 4].view(dtype)

    def _upload_rope(self) -> None:
        from runtime.artifact.formats import f32_to_bf16

        c = self.config
        rd = c.rotary_dim
        inv_freq = c.rope_theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
        angles = np.arange(self.rope_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
        self._rope_host = (f32_to_bf16(np.cos(angles).astype(np.float32)),
                           f32_to_bf16(np.sin(angles).astype(np.float32)))
        self.device.memcpy_htod(self.buf["cos"], self._rope_host[0], self.stream)
        self.device.memcpy_htod(self.buf["sin"], self._rope_host[1], self.stream)

    # ------------------------------------------------------------------ ModelRunner protocol

    def reset_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self._ahead = None
        slot = self._phys[slot]
        for state, window in zip(self.states, self.windows):
            self.device.memset_d8(state + slot * self.state_slot_bytes, 0, self.state_slot_bytes, self.stream)
            self.device.memset_d8(window + slot * self.win_slot_bytes, 0, self.win_slot_bytes, self.stream)

    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)
        self._ahead = None
        src, dst = self._phys[src], self._phys[dst]
        for state, window in zip(self.states, self.windows):
            self.device.memcpy_dtod(state + dst * self.state_slot_bytes, state + src * self.state_slot_bytes,
                                    self.state_slot_bytes, self.stream)
            self.device.memcpy_dtod(window + dst * self.win_slot_bytes, window + src * self.win_slot_bytes,
                                    self.win_slot_bytes, self.stream)

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        return self._prefill(chunk, sample=False)

    def prefill_sampled(self, chunk: PrefillChunk, sampling: Callable[[], Sequence[RowSampling]]) -> np.ndarray:
        """Compute a chunk and sample the token after its last position on the device (as
        `decode_sampled` does for a decode row): int32 ids [1]."""
        if chunk.all_logits:
            raise ValueError("prefill_sampled samples the last position; all_logits asks for logits")
        self._prefill(chunk, sample=True)
        rows = list(sampling())
        if len(rows) != 1:
            raise ValueError(f"sampling gave {len(rows)} rows for one prefill chunk")
        self._queue_sampling(rows).synchronize()
        return self.sample_host["ids"][:1].copy()

    def _prefill(self, chunk: PrefillChunk, *, sample: bool) -> np.ndarray:
        tokens = checked_tokens(chunk.token_ids, self.vocab_size)
        self._check_slot(chunk.slot)
        start = int(chunk.start_pos)
        if start < 0:
            raise ValueError(f"start_pos must be >= 0, got {start}")
        end = start + len(tokens)
        if end > self.max_context:
            raise ValueError(f"positions up to {end - 1} exceed this runner's context of {self.max_context}")
        pages = checked_page_table(chunk.page_table, end, self.num_pages)
        self._ahead = None
        outputs = []
        for lo in range(0, len(tokens), self.prefill_chunk):
            piece = tokens[lo:lo + self.prefill_chunk]
            last = lo + len(piece) == len(tokens)
            want = "none" if not last and not chunk.all_logits else \
                "all" if chunk.all_logits else "sample" if sample else "last"
            out = self._prefill_piece(self._phys[chunk.slot], piece, start + lo, pages, want)
            if out is not None:
                outputs.append(out)
        return np.concatenate(outputs, axis=0) if outputs else np.zeros((0, self.vocab_size), np.float32)

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        self._ahead = None
        return self._read_logits(0, self._launch_decode(items))

    def decode_sampled(self, items: Sequence[DecodeItem], sampling: Callable[[], Sequence[RowSampling]],
                       lookahead: bool = False) -> np.ndarray:
        """One token for each item, sampled on the device: int32 ids [len(items)] (`DEAD_END`
        where a row's mask allows nothing). `sampling()` gives each row's inputs; it is called
        once the forward pass is queued, so the host builds them while the GPU computes.

        lookahead: the caller expects to decode the same sequences again next, each with the
        token sampled here at the next position. The runner then queues that step's forward
        pass before returning (its input ids copied on the device from the sampler's output,
        its GDN states and conv windows written to spare slots), so the GPU computes step t+1
        while the host handles step t. The next call uses it if its items are exactly those
        (same slots in the same order, positions + 1, the sampled ids, the same pages) and
        discards it otherwise; a discarded step changed nothing but K/V rows at positions the
        real step rewrites before any query reads them."""
        ahead, self._ahead = self._ahead, None
        used = ahead is not None and ahead.matches(items)
        if ahead is not None:
            self.lookahead_steps[used] += 1
        if used:
            b = len(items)
            for logical, spare in zip(ahead.slots, ahead.spares):
                self._spares[self._spares.index(spare)] = self._phys[logical]
                self._phys[logical] = spare
        else:
            b = self._launch_decode(items)
        rows = list(sampling())
        if len(rows) != b:
            raise ValueError(f"sampling gave {len(rows)} rows for {b} decode items")
        done = self._queue_sampling(rows)
        ahead = self._launch_ahead(items) if lookahead else None
        done.synchronize()
        ids = self.sample_host["ids"][:b].copy()
        if ahead is not None:
            ahead.tokens = ids
            self._ahead = ahead
        return ids

    def _launch_decode(self, items: Sequence[DecodeItem]) -> int:
        """Queue the decode step of `items` (logits rows 0..b-1 in the logits buffer); b."""
        b = len(items)
        if b == 0:
            raise ValueError("decode needs at least one item")
        if b > self.max_batch:
            raise ValueError(f"decode batch of {b} exceeds max_batch {self.max_batch}")
        slots = [int(item.slot) for item in items]
        for s in slots:
            self._check_slot(s)
        if len(set(slots)) != b:
            raise ValueError(f"decode items must use distinct slots, got {slots}")
        tokens = checked_tokens([item.token_id for item in items], self.vocab_size)
        positions = [int(item.pos) for item in items]
        for pos in positions:
            if pos < 0 or pos >= self.max_context:
                raise ValueError(f"decode position {pos} outside [0, {self.max_context})")
        tables = [checked_page_table(item.page_table, pos + 1, self.num_pages) for item, pos in zip(items, positions)]
        meta = self._meta_clear()
        phys = [self._phys[s] for s in slots]
        bucket = self._decode_meta(meta, positions, tables, phys, phys)
        meta["ids"][:b] = tokens
        self._upload_step(tokens, bucket)
        self._run_decode(bucket)
        return b

    def _decode_meta(self, meta: dict[str, np.ndarray], positions: Sequence[int], tables: Sequence[np.ndarray],
                     slots_in: Sequence[int], slots_out: Sequence[int]) -> int:
        """Fill a decode step's metadata (all but the ids): row i at `positions[i]` over the pages
        `tables[i]`, its GDN state and conv window read from physical slot `slots_in[i]` and
        written to `slots_out[i]`; the rows up to the batch bucket use the pad page and slot.
        Returns the bucket."""
        b = len(positions)
        bucket = next(x for x in BUCKETS if x >= b)
        table = meta["table"].reshape(self.max_batch, self.maxp)
        table[:] = self.num_pages  # pad page
        for i, (pos, pages) in enumerate(zip(positions, tables)):
            table[i, :len(pages)] = pages
            meta["pos"][i] = pos
            meta["wrow"][i] = pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        meta["wrow"][b:bucket] = self.num_pages * PAGE_SIZE
        meta["qseq"][:bucket] = np.arange(bucket)
        meta["slots_in"][:bucket] = self.pad_slot
        meta["slots_in"][:b] = slots_in
        meta["slots"][:bucket] = self.pad_slot
        meta["slots"][:b] = slots_out
        return bucket

    def _run_decode(self, bucket: int) -> None:
        if self.cuda_graphs:
            graph = self._graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket)
            graph.replay(self.stream)
        else:
            for launch in self._decode_plan(bucket):
                launch(self.stream)

    def _launch_ahead(self, items: Sequence[DecodeItem]) -> "_Ahead | None":
        """Queue the decode step after `items` (see `decode_sampled`); None where it cannot be
        computed ahead: no embedding kernel (ids are gathered on the host), too few spare slots,
        a position past the context, or a next position whose page the table does not hold yet."""
        b = len(items)
        if not self.kernels.embedding or b > len(self._spares):
            return None
        positions = [int(item.pos) + 1 for item in items]
        tables = [np.asarray(item.page_table, dtype=np.int64).reshape(-1) for item in items]
        if any(p >= self.max_context or p // PAGE_SIZE >= len(t) for p, t in zip(positions, tables)):
            return None
        tables = [checked_page_table(t, p + 1, self.num_pages) for p, t in zip(positions, tables)]
        spares = self._spares[:b]
        meta = self._meta_views(self._next_meta_block())
        bucket = self._decode_meta(meta, positions, tables, [self._phys[int(item.slot)] for item in items], spares)
        self._upload_meta()
        self.device.memcpy_dtod(self.buf["meta"] + self.meta_off["ids"] * 4, self.buf["sample_ids"], b * 4,
                                self.stream)
        self._run_decode(bucket)
        return _Ahead(slots=[int(item.slot) for item in items], positions=positions, tables=tables,
                      tokens=np.zeros(0, np.int32), spares=spares)

    # ------------------------------------------------------------------ steps

    def _prefill_piece(self, slot: int, tokens: np.ndarray, start: int, pages: np.ndarray, want: str
                       ) -> np.ndarray | None:
        t = len(tokens)
        end = start + t
        split = _cdiv(_cdiv(end, PREFILL_SPLITS), PAGE_SIZE) * PAGE_SIZE
        splits = _cdiv(end, split)
        meta = self._meta_clear()
        positions = np.arange(start, end)
        meta["pos"][:t] = positions
        meta["wrow"][:t] = pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        meta["ids"][:t] = tokens
        meta["slots"][0] = slot
        meta["slots_in"][0] = 0
        table = meta["table"].reshape(self.max_batch, self.maxp)
        table[0, :len(pages)] = pages
        # The conv kernel reads the old windows from a scratch copy (its writers and readers
        # differ when the piece is longer than one thread's tokens).
        for n, window in enumerate(self.windows):
            self.device.memcpy_dtod(self.buf["win_scratch"] + n * self.win_slot_bytes,
                                    window + slot * self.win_slot_bytes, self.win_slot_bytes, self.stream)
        self._upload_step(tokens, t)
        for launch in self._plan(("prefill", t, splits, split), lambda: self._bind_forward(t, 1, t, splits, split,
                                                                                       prefill=True)):
            launch(self.stream)
        if want == "none":
            return None
        if want == "sample":  # the last row's logits stay in the logits buffer for the sampler
            for launch in self._plan(("lm_head", t - 1, 1), lambda: self._bind_lm_head(t - 1, 1)):
                launch(self.stream)
            return None
        rows = range(t) if want == "all" else range(t - 1, t)
        out = []
        for lo in range(rows.start, rows.stop, self.logit_rows):
            n = min(self.logit_rows, rows.stop - lo)
            for launch in self._plan(("lm_head", lo, n), lambda: self._bind_lm_head(lo, n)):
                launch(self.stream)
            out.append(self._read_logits(0, n))
        return np.concatenate(out, axis=0)

    def _decode_plan(self, bucket: int) -> list:
        def bind() -> list:
            return self._bind_forward(bucket, bucket, 1, self.decode_splits, self.decode_split, prefill=False) \
                + self._bind_lm_head(0, bucket)
        return self._plan(("decode", bucket), bind)

    def _capture(self, bucket: int) -> Any:
        from runtime.cuda.device import capture_graph

        plan = self._decode_plan(bucket)

        def record() -> None:
            for launch in plan:
                launch(self.stream)
        graph = capture_graph(self.device, self.stream, record)
        self._graphs[bucket] = graph
        return graph

    def _plan(self, key: tuple, bind: Callable[[], list]) -> list:
        """Bound launches of a step shape, bound once. Decode plans stay (graphs replay their
        parameters); prefill shapes are kept for the 32 most recent."""
        plan = self._plans.get(key)
        if plan is None:
            plan = bind()
            self._plans[key] = plan
            prefill_keys = [k for k in self._plans if k[0] != "decode"]
            if len(prefill_keys) > 32:
                del self._plans[prefill_keys[0]]
        else:
            self._plans.move_to_end(key)
        return plan

    # ------------------------------------------------------------------ binding

    def _bind_forward(self, m: int, nseq: int, t: int, splits: int, split: int, *, prefill: bool) -> list:
        c, k, lib, buf = self.config, self.kernels, self.library, self.buf
        wbase = self.arenas["weights"].base
        meta = buf["meta"]

        def mptr(name: str) -> int:
            return meta + self.meta_off[name] * 4

        launches: list = []

        def launch(family: str, key: str, bufs: dict, sizes: dict) -> None:
            launches.append(lib.kernel(family, key).bind(bufs, sizes))

        def w(slot: Any) -> int:
            return wbase + slot.offset

        def linear(x: int, slot: Any, out: int, rows: int) -> None:
            n, kk = slot.shape
            fam, key = k.linear(n, kk, rows)
            launch(fam, key, {"x": x, "w": w(slot), "out": out}, {"M": rows})

        h = c.hidden_size
        if k.embedding:
            launch("embedding", k.embedding, {"ids": mptr("ids"), "table": w(self.layout.globals["embed"]),
                                              "out": buf["resid"], "err": mptr("err")}, {"M": m})
        gdn_index = attn_index = 0
        for i, layer in enumerate(self.layout.layers):
            if i == 0:
                launch("rmsnorm", k.norm, {"x": buf["resid"], "w": w(layer["input_norm"]), "out": buf["h"]},
                       {"M": m})
            else:
                launch("rmsnorm", k.add_norm, {"x": buf["delta"], "residual": buf["resid"],
                                               "w": w(layer["input_norm"]), "out": buf["h"]}, {"M": m})
            if c.layer_types[i] == LINEAR_ATTENTION:
                n = gdn_index
                gdn_index += 1
                linear(buf["h"], layer["w_in"], buf["proj"], m)
                win_in = buf["win_scratch"] + n * self.win_slot_bytes if prefill else self.windows[n]
                launch("conv1d", k.conv, {"x": buf["proj"], "w": w(layer["conv"]), "win_in": win_in,
                                          "win_out": self.windows[n], "slots_in": mptr("slots_in"),
                                          "slots_out": mptr("slots"), "out": buf["conv_out"]},
                       {"B": nseq, "T": t, "NI": 1 if prefill else self.phys_slots, "NO": self.phys_slots})
                gdn_args = {"qkv": buf["conv_out"], "x": buf["proj"], "a_log": w(layer["a_log"]),
                            "dt_bias": w(layer["dt_bias"]), "state": self.states[n], "slots": mptr("slots")}
                if prefill and (k.gdn_chunked or k.gdn_split):
                    # The chunked or split kernel (un-normalised o into gdn_out), then the gated
                    # norm in place, z read from the projection rows.
                    family, key = ("gdn_chunked", k.gdn_chunked) if k.gdn_chunked else ("gdn", k.gdn_split)
                    launch(family, key, {**gdn_args, "out": buf["gdn_out"]},
                           {"B": nseq, "T": t, "NS": self.phys_slots})
                    launch("rmsnorm", k.gdn_norm, {"x": buf["gdn_out"], "z": buf["proj"],
                                                   "w": w(layer["gdn_norm"]), "out": buf["gdn_out"]},
                           {"M": m * c.linear_num_value_heads})
                else:
                    # Decode reads each state at slots_in and writes it at slots (the same slot,
                    # or a spare for a step computed ahead); prefill works in place.
                    launch("gdn", k.gdn, {**gdn_args, "slots": mptr("slots" if prefill else "slots_in"),
                                          "slots_out": mptr("slots"), "norm_w": w(layer["gdn_norm"]),
                                          "out": buf["gdn_out"]},
                           {"B": nseq, "T": t, "NS": self.phys_slots})
                linear(buf["gdn_out"], layer["out_proj"], buf["delta"], m)
            else:
                n = attn_index
                attn_index += 1
                linear(buf["h"], layer["w_qkv"], buf["proj"], m)
                pages = {"k_pages": self.k_pages[n], "v_pages": self.v_pages[n]}
                launch("attention", k.prep, {"x": buf["proj"], "qn_w": w(layer["q_norm"]), "kn_w": w(layer["k_norm"]),
                                             "cos": buf["cos"], "sin": buf["sin"], "pos": mptr("pos"),
                                             "wrow": mptr("wrow"), "q_out": buf["q"], **pages},
                       {"M": m, "P": self.rope_positions, "NP": self.num_pages + 1})
                if prefill and getattr(k, "prefill_attn", None):
                    launch("attention_prefill", k.prefill_attn,
                           {"q": buf["q"], **pages, "table": mptr("table"), "qseq": mptr("qseq"), "pos": mptr("pos"),
                            "x": buf["proj"], "out": buf["attn_out"]},
                           {"M": m, "maxp": self.maxp, "R": self.max_batch, "NP": self.num_pages + 1})
                else:
                    launch("attention", k.split, {"q": buf["q"], **pages, "table": mptr("table"),
                                                  "qseq": mptr("qseq"), "pos": mptr("pos"), "o_part": buf["o_part"],
                                                  "lse": buf["lse"]},
                           {"M": m, "S": splits, "split": split, "maxp": self.maxp, "R": self.max_batch,
                            "NP": self.num_pages + 1})
                    launch("attention", k.combine, {"o_part": buf["o_part"], "lse": buf["lse"], "pos": mptr("pos"),
                                                    "x": buf["proj"], "out": buf["attn_out"]},
                           {"M": m, "S": splits, "split": split})
                linear(buf["attn_out"], layer["o_proj"], buf["delta"], m)
            launch("rmsnorm", k.add_norm, {"x": buf["delta"], "residual": buf["resid"], "w": w(layer["post_norm"]),
                                           "out": buf["h"]}, {"M": m})
            linear(buf["h"], layer["w_gate_up"], buf["proj"], m)
            launch("silu_mul", k.silu_mul, {"x": buf["proj"], "out": buf["act"]}, {"M": m})
            linear(buf["act"], layer["down"], buf["delta"], m)
        launch("rmsnorm", k.add_norm, {"x": buf["delta"], "residual": buf["resid"],
                                       "w": w(self.layout.globals["norm"]), "out": buf["h"]}, {"M": m})
        del h
        return launches

    def _bind_lm_head(self, row0: int, rows: int) -> list:
        c = self.config
        slot = self.layout.globals.get("lm_head") or self.layout.globals["embed"]
        n, kk = slot.shape
        fam, key = self.kernels.linear(n, kk, rows)
        x = self.buf["h"] + row0 * c.hidden_size * 2
        return [self.library.kernel(fam, key).bind(
            {"x": x, "w": self.arenas["weights"].base + slot.offset, "out": self.buf["logits"]}, {"M": rows})]

    # ------------------------------------------------------------------ sampling

    def _queue_sampling(self, rows: Sequence[RowSampling]) -> Any:
        """Queue the sampling of logits rows 0..len(rows)-1 with the `sampling` kernels: the rows'
        inputs go up in one pinned block (row parameters, bitmasks, penalty lists), the ids come
        back into `sample_host["ids"]`; returns the event that marks them there."""
        b = len(rows)
        v, words = self.vocab_size, self.mask_words
        host = self.sample_host
        row_i32 = host["row_i32"].reshape(self.max_batch, ROW_I32)
        row_f32 = host["row_f32"].reshape(self.max_batch, ROW_F32)
        masks = host["bitmask"].reshape(self.max_batch, words)
        pen = 0
        for r, row in enumerate(rows):
            n = len(row.penalty_ids)
            if pen + n > self.max_penalties:
                raise ValueError(f"{pen + n} penalised ids in one step exceed the {self.max_penalties} reserved")
            if n and (row.penalty_ids.min() < 0 or row.penalty_ids.max() >= v):
                raise ValueError(f"penalised ids must be in [0, {v})")
            host["pen_ids"][pen:pen + n] = row.penalty_ids
            host["pen_delta"][pen:pen + n] = row.penalty_deltas
            if row.bitmask is not None:
                if row.bitmask.shape != (words,):
                    raise ValueError(f"bitmask of row {r} has shape {row.bitmask.shape}, not ({words},)")
                masks[r] = row.bitmask.view(np.uint32)
            pen += fill_row(row, row_i32[r], row_f32[r], pen)
        dev, st, off = self.device, self.stream, self.sample_off
        for name in ("row_i32", "row_f32", "bitmask"):
            dev.memcpy_htod(self.buf["sample_in"] + off[name], host[name], st)
        if pen:
            dev.memcpy_htod(self.buf["sample_in"] + off["pen_ids"], host["pen_ids"][:pen], st)
            dev.memcpy_htod(self.buf["sample_in"] + off["pen_delta"], host["pen_delta"][:pen], st)
        for launch in self._plan(("sample", b), lambda: self._bind_sampling(b)):
            launch(st)
        dev.memcpy_dtoh(host["ids"][:b], self.buf["sample_ids"], st)
        self._ids_ready.record(st)
        return self._ids_ready

    def _bind_sampling(self, rows: int) -> list:
        k, lib, buf, off = self.kernels, self.library, self.buf, self.sample_off
        inputs = {name: buf["sample_in"] + off[name] for name in ("row_i32", "row_f32", "bitmask", "pen_ids",
                                                                 "pen_delta")}
        cands = {"cand_val": buf["cand_val"], "cand_id": buf["cand_id"]}
        return [
            lib.kernel("sampling", k.sample_candidates).bind(
                {"logits": buf["logits"], "bitmask": inputs["bitmask"], "row_i32": inputs["row_i32"],
                 "pen_ids": inputs["pen_ids"], "pen_delta": inputs["pen_delta"], **cands},
                {"R": rows, "V": self.vocab_size}),
            lib.kernel("sampling", k.sample_pick).bind(
                {**cands, "row_i32": inputs["row_i32"], "row_f32": inputs["row_f32"], "ids": buf["sample_ids"]},
                {"R": rows}),
        ]

    # ------------------------------------------------------------------ host <-> device

    def _next_meta_block(self) -> np.ndarray:
        """The other pinned metadata block, zeroed (the one the last upload read stays intact)."""
        self._meta_turn ^= 1
        arr = self.meta_hosts[self._meta_turn].array(np.int32, self.meta_count)
        arr[:] = 0
        return arr

    def _meta_views(self, arr: np.ndarray) -> dict[str, np.ndarray]:
        return {name: arr[off:off + self.meta_size[name]] for name, off in self.meta_off.items()}

    def _meta_clear(self) -> dict[str, np.ndarray]:
        self.stream.synchronize()  # earlier uploads may still read the pinned blocks
        return self._meta_views(self._next_meta_block())

    def _upload_meta(self) -> None:
        """Upload the metadata block filled last."""
        self.device.memcpy_htod(self.buf["meta"], self.meta_hosts[self._meta_turn].array(np.int32, self.meta_count),
                                self.stream)

    def _upload_step(self, tokens: np.ndarray, rows: int) -> None:
        self._upload_meta()
        if not self.kernels.embedding:
            embed = self._embed_table()
            host = self.embed_host.array(np.uint16, rows * self.config.hidden_size).reshape(rows, -1)
            host[:len(tokens)] = embed[tokens]
            host[len(tokens):] = 0
            self.device.memcpy_htod(self.buf["resid"], host, self.stream)

    def _embed_table(self) -> np.ndarray:
        """The bf16 embedding table on the host, for shapes without an embedding kernel (the
        tiny test models): the artifact's mapped tensor, or a copy of the synthetic one."""
        if self._component is not None:
            return self._component.raw("embed_tokens.weight")
        if self._host_embed is None:
            slot = self.layout.globals["embed"]
            table = np.empty(slot.shape, np.uint16)
            self.device.memcpy_dtoh(table, self.arenas["weights"].base + slot.offset, self.stream)
            self.stream.synchronize()
            self._host_embed = table
        return self._host_embed

    def _read_logits(self, row0: int, rows: int) -> np.ndarray:
        v = self.config.vocab_size
        host = self.logits_host.array(np.uint16, rows * v)
        self.device.memcpy_dtoh(host, self.buf["logits"] + row0 * v * 2, self.stream)
        self.stream.synchronize()
        return (host.astype(np.uint32) << 16).view(np.float32).reshape(rows, v).copy()

    def read_state(self, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(recurrent state [Hv, dk, dv] fp32, conv window [Kc-1, conv_dim] fp32) of the n-th GDN
        layer, in `NumpyRunner`'s layout (tests)."""
        c = self.config
        st = np.empty((c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim), np.float32)
        win = np.empty((c.linear_conv_kernel_dim - 1, c.conv_dim), np.uint16)
        self.stream.synchronize()
        slot = self._phys[slot]
        self.device.memcpy_dtoh(st, self.states[layer] + slot * self.state_slot_bytes, self.stream)
        self.device.memcpy_dtoh(win, self.windows[layer] + slot * self.win_slot_bytes, self.stream)
        self.stream.synchronize()
        return np.swapaxes(st, 1, 2).copy(), (win.astype(np.uint32) << 16).view(np.float32)

    # ------------------------------------------------------------------ checks

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} out of range (num_slots = {self.num_slots})")

    def close(self) -> None:
        self.stream.synchronize()
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
        self._plans.clear()
        for pinned in (*self.meta_hosts, self.logits_host, self.embed_host, self.sample_pinned):
            if pinned is not None:
                pinned.free()
        self.arenas.release()
