"""Device memory of `CudaRunner`, planned and reserved once at construction.

Arenas (`runtime.cuda.memory.DeviceArenas`):
- weights: `weights.WeightLayout.total` bytes, bf16 as stored in the artifact;
- KV pages: per full-attention layer, then per MTP layer (its own pool, read through the same page
  tables), K and V `[(num_pages + 1) * 64, Hkv, D]` bf16, post-norm and post-RoPE (the paging
  contract of `runtime/model/runner.py`), or with `--kv-dtype fp8|int8` the same pages as codes
  and per token-head scales (`runtime.model.kv_format`, `page_bytes` each); page `num_pages` is a
  pad page that padded decode rows write into;
- state slots: per GDN layer the fp32 recurrent state `[phys_slots, Hv, dv, dk]` (v-major) and the
  conv window `[phys_slots, Kc - 1, conv_dim]` bf16, over the physical slots of `StateSlots`;
- workspace: activations for `rows = max(prefill_chunk, max_batch)` rows, attention split
  partials, the logits rows, RoPE tables, the MoE routing and expert activations, the
  device-sampling blocks and one int32 metadata block (per-step values: token ids, positions, KV
  rows, slots, page tables); with an MTP head its rows (`mtp_x`: [embedding | hidden] rows of 2H,
  `mtp_in`: the hidden rows it reads, `mtp_chain`: its own outputs when chaining drafts), the kept
  hidden rows (`mtp_kept`: `max_batch` entries of `rows` rows, `gpu.mtp.KeptHidden`), those of
  a decode step computed ahead (`mtp_ahead`), the draft chain's staged metadata blocks
  (`mtp_meta`) and draft ids (`mtp_drafts`, `gpu.mtp_chain`); prefill's expert-sorted MoE rows
  (`gpu.moe_prefill`).

Host side: two pinned metadata blocks used in turn, a pinned logits staging buffer of
`logit_rows` rows (logits are read back in blocks of that many), the host-gathered embedding
rows, and the pinned sampling block mirrored on the device; with an MTP head the chain's pinned
metadata blocks and draft ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.cuda.memory import DeviceArenas
from runtime.model.config import ModelConfig
from runtime.model.kv_format import page_bytes
from runtime.model.runner import MTP_MAX_DRAFTS, PAGE_SIZE
from runtime.model.sampling import ROW_F32, ROW_I32, TOP_K_CAP

BUCKETS = (1, 2, 4, 8)
PREFILL_SPLITS = 16  # KV splits per query row in prefill (split-KV fallback, MTP catch-up)
PREFILL_MIN_SPLIT = PAGE_SIZE  # fewest keys per split there
# Keys per split of the WGMMA prefill attention over a long context (at least; see
# `prefill_kv_split`): a chunk of 1K rows over 116K keys otherwise runs 8 query tiles x 24 heads =
# 192 CTAs on 132 SMs (two waves, one 45 % full), and a 40-row chunk 24 CTAs.
PREFILL_KV_SPLIT = 16384
# Decode attention: the split count per row is fixed at startup (the graph's grid), each row's split
# length follows its own position (`attention.split_length`). At batch 1, DECODE_CTAS_PER_SM (row,
# KV head, split) CTAs per SM: one wave of the tensor-core split kernel, which keeps 2 CTAs
# resident per SM over every page format (bf16: 106 KB of shared memory; fp8 `k4cvt`: 227
# registers a thread); and at least DECODE_MIN_SPLIT keys per split, so a short context does not
# pay for a combine over many tiny splits. On the H200 at 250K keys, batch 1, 27B heads (ninth
# session, split + combine): 66 splits bf16 247 us, fp8 136 us; 198 (3 waves, the CUDA-core split
# kernel's plan of 6 CTAs per SM before): 262 / 156 us.
DECODE_CTAS_PER_SM = 2
DECODE_MIN_SPLIT = 128
LOGITS_BYTES = 256 << 20  # the logits staging buffer's budget (device and pinned host alike)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_kv_split(max_context: int, prefill_chunk: int) -> int:
    """Keys per split of the prefill attention over key splits: at least `PREFILL_KV_SPLIT`,
    few enough splits for the partials (`PREFILL_SPLITS` per row), and a multiple of the prefill
    chunk. Chunks lie on the prefill-chunk grid, so no chunk straddles a multiple of it: a chunk
    takes the split kernel iff it starts at or past it, and then every row's keys are cut at the
    same absolute multiples of it whatever chunk the row is in (request invariance)."""
    split = max(PREFILL_KV_SPLIT, cdiv(max_context, PREFILL_SPLITS))
    return cdiv(split, prefill_chunk) * prefill_chunk


def default_decode_splits(kv_heads: int, max_context: int, sm_count: int, min_split: int = DECODE_MIN_SPLIT) -> int:
    """Decode attention splits per row: `DECODE_CTAS_PER_SM` CTAs per SM at batch 1, no more than
    the longest context can use (its keys over `min_split`)."""
    return max(1, min(cdiv(DECODE_CTAS_PER_SM * sm_count, max(kv_heads, 1)), cdiv(max_context, min_split)))


class StateSlots:
    """The engine's state slots over physical ones.

    Physical slots: the engine's `num_slots`, then `spares` (which receive the states of a decode
    step computed ahead, `step.Ahead`), then one pad slot that padded decode rows read and write.
    `phys[logical]` is where a slot's state is now: using a step computed ahead and `commit`
    swap entries instead of copying states.
    """

    def __init__(self, num_slots: int, spares: int):
        self.num_slots = num_slots
        self.phys_slots = num_slots + spares + 1
        self.pad_slot = self.phys_slots - 1
        self.phys = list(range(num_slots))
        self.spares = list(range(num_slots, num_slots + spares))

    def check(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} out of range (num_slots = {self.num_slots})")

    def swap(self, a: int, b: int) -> None:
        """Exchange the physical slots behind logical slots a and b."""
        self.phys[a], self.phys[b] = self.phys[b], self.phys[a]

    def adopt_spare(self, logical: int, spare: int) -> None:
        """Make `spare` the physical slot of `logical`; its old one becomes that spare."""
        self.spares[self.spares.index(spare)] = self.phys[logical]
        self.phys[logical] = spare


class Storage:
    """The arenas, buffers and metadata layout of one runner (see the module docstring).

    buf: workspace buffer name -> device address; k_pages / v_pages: per attention layer;
    states / windows: per GDN layer; meta_off / meta_size: int32 offset and count of each
    metadata field; sample_off: byte offset of each device-sampling input in `buf["sample_in"]`.
    """

    def __init__(self, config: ModelConfig, device: Any, kernels: Any, *, weight_bytes: int, num_pages: int,
                 phys_slots: int, max_batch: int, prefill_chunk: int, max_context: int,
                 decode_splits: int | None = None, decode_min_split: int = DECODE_MIN_SPLIT, mtp_layers: int = 0,
                 media: bool = False, fp8_k: int = 0, nvfp4_weights: int = 0, kv_dtype: str = "bf16"):
        c = self.config = config
        self.device = device
        self.num_pages = num_pages
        self.max_batch = max_batch
        self.max_context = max_context
        self.maxp = cdiv(max_context, PAGE_SIZE)
        self.decode_min_split = decode_min_split
        self.decode_splits = decode_splits or default_decode_splits(config.num_key_value_heads, max_context,
                                                                    device.sm_count, decode_min_split)
        rows = self.rows = max(prefill_chunk, max_batch)
        self.prefill_kv_split = prefill_kv_split(max_context, prefill_chunk)
        self.prefill_kv_splits = cdiv(max_context, self.prefill_kv_split)  # <= PREFILL_SPLITS
        h = c.hidden_size
        n_gdn, n_kv = len(c.linear_layers), len(c.attention_layers) + mtp_layers
        self.kv_dtype = kv_dtype
        self.page_bytes = page_bytes(kv_dtype, c.num_key_value_heads, c.head_dim)  # one layer's K (or V) page
        kv_bytes = (num_pages + 1) * self.page_bytes
        self.win_slot_bytes = (c.linear_conv_kernel_dim - 1) * c.conv_dim * 2
        self.state_slot_bytes = c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim * 4
        state_bytes = phys_slots * self.state_slot_bytes
        win_bytes = phys_slots * self.win_slot_bytes
        k = kernels
        proj_w = max(k.gdn_stride, k.attn_stride, 2 * (c.intermediate_size or 0))
        hq, d = c.num_attention_heads, c.head_dim
        part_rows = max(max_batch * self.decode_splits, rows * PREFILL_SPLITS) * hq
        self.part_rows = part_rows // hq  # query rows x splits the attention partials hold
        self.rope_positions = min(c.max_position_embeddings, max(max_context, 1))
        # With media (`vision_rows`) the prep kernel rotates at `rope_pos`, and the table rows past
        # the positions hold a prefill piece's own MRoPE angles, one per row.
        self.rope_rows = self.rope_positions + (rows if media else 0)
        # Logits rows staged at once: every row of a step where the budget allows, else as many
        # whole 128-row tiles of the lm_head GEMM as fit (a 2,048-token chunk of a 248K vocabulary
        # reads back in blocks of 512), never fewer than a decode batch.
        budget_rows = LOGITS_BYTES // (c.vocab_size * 2)
        self.logit_rows = max(max_batch, min(rows, budget_rows // 128 * 128 or budget_rows))
        sizes = {
            "resid": rows * h * 2, "h": rows * h * 2, "delta": rows * h * 2, "proj": rows * proj_w * 2,
            "conv_out": rows * c.conv_dim * 2, "gdn_out": rows * c.linear_value_dim * 2,
            "q": rows * hq * d * 2, "attn_out": rows * hq * d * 2, "act": rows * (c.intermediate_size or 0) * 2,
            "o_part": part_rows * d * 4, "lse": part_rows * 4,
            "logits": self.logit_rows * c.vocab_size * 2,
            "cos": self.rope_rows * (c.rotary_dim // 2) * 2, "sin": self.rope_rows * (c.rotary_dim // 2) * 2,
            "win_scratch": max(n_gdn, 1) * self.win_slot_bytes,
        }
        if fp8_k:
            # The FP8 prefill GEMM's quantised activations (e4m3 codes and a fp32 scale per row and
            # 128 columns) of one linear at a time; fp8_k: the widest input of an FP8 linear that runs it.
            sizes.update({"fp8_x": rows * fp8_k, "fp8_scale": rows * cdiv(fp8_k, 128) * 4})
        if nvfp4_weights:
            # The NVFP4 prefill path's weight decoded to bf16, one linear at a time; nvfp4_weights:
            # the most elements of an NVFP4 linear that runs it.
            sizes["nvfp4_w"] = nvfp4_weights * 2
        if mtp_layers:
            sizes.update({"mtp_x": rows * 2 * h * 2, "mtp_in": rows * h * 2, "mtp_chain": max_batch * h * 2,
                          "mtp_kept": max_batch * rows * h * 2, "mtp_ahead": max_batch * h * 2})
        if k.moe_route:
            # MoE (cute_kernels/moe.py): router logits, then per row k routed slots + the shared one.
            p = c.num_experts_per_tok + 1
            sizes.update({"moe_logits": rows * c.num_experts * 4, "moe_ids": rows * p * 4, "moe_wts": rows * p * 4,
                          "moe_act": rows * p * (c.moe_intermediate_size or 0) * 2})
            if k.moe_prefill:
                # Prefill's expert-sorted rows (`gpu.moe_prefill`).
                sizes.update(k.moe_prefill.buffer_sizes(rows, h, c.moe_intermediate_size))
        # Device sampling: each row's inputs (parameters, packed mask, penalty list) in one block
        # mirrored by a pinned host block, the per-CTA candidates, the sampled ids.
        self.mask_words = cdiv(c.vocab_size, 32)
        self.max_penalties = max_batch * min(max_context, c.vocab_size)
        # Rows one device sampling takes: a decode step's, or a verification step's positions of
        # up to 1 + MTP_MAX_DRAFTS tokens a sequence (`CudaRunner.step_sampled`; longer ones go in
        # several samplings).
        sr = self.sample_rows = max_batch * (1 + MTP_MAX_DRAFTS)
        sample_fields = (("row_i32", sr * ROW_I32, np.int32),
                         ("row_f32", sr * ROW_F32, np.float32),
                         ("bitmask", sr * self.mask_words, np.uint32),
                         ("pen_ids", self.max_penalties, np.int32), ("pen_delta", self.max_penalties, np.float32),
                         ("ids", sr, np.int32))
        self.sample_off: dict[str, int] = {}
        off = 0
        for name, count, _ in sample_fields:
            self.sample_off[name] = off
            off += cdiv(count * 4, 256) * 256
        sample_bytes = off
        if k.sample_candidates:
            cands = sr * k.sample_ctas * TOP_K_CAP * 4
            sizes.update({"sample_in": sample_bytes, "cand_val": cands, "cand_id": cands, "sample_ids": sr * 4})
        # Metadata (int32): ids, pos, wrow, qseq, slots, slots_in [rows] (a verification step
        # has a snapshot slot per row: `layers.StepShape`); err; table [max_batch, maxp].
        self.meta_size = {"ids": rows, "pos": rows, "wrow": rows, "qseq": rows, "slots": rows,
                          "slots_in": rows, "err": 4, "table": max_batch * self.maxp}
        if media:
            self.meta_size["rope_pos"] = rows  # the rotary table row of each row (`vision_rows`)
        self.meta_off: dict[str, int] = {}
        off = 0
        for name, count in self.meta_size.items():
            self.meta_off[name] = off
            off += cdiv(count, 64) * 64
        self.meta_count = off
        sizes["meta"] = off * 4
        if mtp_layers:
            # The MTP draft chain (`gpu.mtp_chain`): the metadata of each chained step, staged at
            # once, and every draft's ids, read back at once.
            sizes.update({"mtp_meta": (MTP_MAX_DRAFTS - 1) * off * 4, "mtp_drafts": MTP_MAX_DRAFTS * max_batch * 4})
        workspace = sum(cdiv(v, 256) * 256 for v in sizes.values()) + 4096
        self.arenas = DeviceArenas.reserve(
            device, weights=weight_bytes + 256, kv_pages=max(n_kv * 2 * kv_bytes, 256),
            state_slots=max(n_gdn * (state_bytes + win_bytes), 256), workspace=workspace)
        ws = self.arenas["workspace"]
        self.buf = {name: ws.take(max(n, 16), name).ptr for name, n in sizes.items()}
        kv = self.arenas["kv_pages"]
        self.k_pages = [kv.take(kv_bytes, f"k{i}").ptr for i in range(n_kv)]
        self.v_pages = [kv.take(kv_bytes, f"v{i}").ptr for i in range(n_kv)]
        st = self.arenas["state_slots"]
        self.states = [st.take(state_bytes, f"state{i}").ptr for i in range(n_gdn)]
        self.windows = [st.take(win_bytes, f"window{i}").ptr for i in range(n_gdn)]
        self.weights_base = self.arenas["weights"].base
        # Two pinned metadata blocks, used in turn: a step computed ahead is prepared in one while
        # the upload of the step before may still read the other.
        self.meta_hosts = [device.pinned(self.meta_count * 4), device.pinned(self.meta_count * 4)]
        self.logits_host = device.pinned(self.logit_rows * c.vocab_size * 2)
        self.embed_host = device.pinned(rows * h * 2)
        self.sample_pinned = device.pinned(sample_bytes) if k.sample_candidates else None
        self.mtp_meta_host = device.pinned((MTP_MAX_DRAFTS - 1) * self.meta_count * 4) if mtp_layers else None
        self.mtp_drafts_host = device.pinned(MTP_MAX_DRAFTS * max_batch * 4) if mtp_layers else None
        self.sample_host: dict[str, np.ndarray] = {}
        if self.sample_pinned is not None:
            raw = self.sample_pinned.array(np.uint8)
            for name, count, dtype in sample_fields:
                start = self.sample_off[name]
                self.sample_host[name] = raw[start:start + count * 4].view(dtype)

    @property
    def verify_rows(self) -> int:
        """The most rows (positions x sequences) one verification step takes: its activations,
        logits and attention partials (every row over all decode splits) must fit."""
        return min(self.rows, self.logit_rows, self.part_rows // self.decode_splits)

    def meta_ptr(self, name: str) -> int:
        """Device address of one metadata field."""
        return self.buf["meta"] + self.meta_off[name] * 4

    def release(self) -> None:
        for pinned in (*self.meta_hosts, self.logits_host, self.embed_host, self.sample_pinned, self.mtp_meta_host,
                       self.mtp_drafts_host):
            if pinned is not None:
                pinned.free()
        self.arenas.release()
