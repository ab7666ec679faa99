"""`NumpyRunner`: the exact NumPy forward pass behind the `ModelRunner` protocol.

It is the oracle for the CUDA kernels and the `--device cpu` backend for tiny models. The maths
lives in `reference_layers`, the batch layout (page tables to KV rows, masks, RoPE angles) in
`numpy_batch`, the MTP drafting loop and its kept hidden states in `numpy_mtp`; this module owns
storage, the host copies, the step contract and the forward pass:

- recurrent states `[linear layers, slots, Hv, dk, dv]` and conv windows
  `[linear layers, slots, Kc-1, conv_dim]` (the last Kc-1 pre-conv `[q|k|v]` inputs);
- K and V pages `[attention layers (+ MTP layers), pages, PAGE_SIZE, Hkv, D]`, post-norm and
  post-RoPE, addressed through each sequence's page table (the contract in `runner.py`).

Prefill runs Gated DeltaNet in the chunked form, decode in the recurrent form. Everything is
computed in the runner's dtype (float32, or float64 for tests); the protocol methods return
float32 logits. A prefill or decode call is checked completely before any state is touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from runtime.model import reference_layers as ref
from runtime.model.config import LINEAR_ATTENTION, ModelConfig
from runtime.model.numpy_batch import Batch, BatchLayout, check_slot, check_start_pos
from runtime.model.numpy_mtp import MtpDrafter
from runtime.model.runner import (PAGE_SIZE, DecodeItem, HostReady, HostTransfer, MtpRow, PrefillChunk,
                                  StepRow, checked_draft_vocab, checked_page_table, checked_pages, checked_rows,
                                  checked_tokens, speculative_round_cost)
from runtime.model.vision_reference import MediaEmbedder, VisionConfig, VisionTower
from runtime.model.weights import (AttentionWeights, ComponentTensors, GdnWeights, LayerWeights,
                                   MoeWeights, bind_mtp, bind_text)


@dataclass(frozen=True)
class StepOutput:
    """Logits [rows, V] and final-normed hidden states [rows', H], both in the runner's dtype.

    For prefill, `logits` has one row per token if `all_logits` else one, while `hidden` always
    has one row per token (the MTP head needs them all). For decode both have one row per item.
    For the MTP head, `hidden` is its output after `mtp.norm` (fed back when chaining drafts).
    """

    logits: np.ndarray
    hidden: np.ndarray


class NumpyRunner:
    """The reference model runner (see module docstring).

    config: the model; weights: canonical text tensors (`embed_tokens.weight`, `layers.0...`);
    mtp_weights: the MTP component's tensors (`fc.weight`, `layers.0...`), or None for no MTP.
    num_pages / num_slots: KV pages and recurrent-state slots to allocate.
    dtype: np.float32 (default) or np.float64.
    vision: the vision tower (`--vision`), or None: rows with media are then refused.
    gdn_prefill_form: "chunked" (default) or "recurrent", the Gated DeltaNet form for prefill.
    vocab_rows: the lm_head rows [start, stop) this runner computes logits for (a tensor-parallel
        rank, `tp_reference.RankRunner`; logits are then [rows, stop - start]); None: all.
    mtp_draft_vocab: MTP drafts over ids 0 .. N - 1 only (`ModelRunner.mtp_draft_vocab`); None:
        the whole vocabulary.
    """

    # The engine samples this runner's logits on the host (the sampler is the same code).
    samples_on_device = False

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], *,
                 num_pages: int, num_slots: int, dtype: Any = np.float32,
                 mtp_weights: Mapping[str, np.ndarray] | None = None,
                 gdn_prefill_form: str = "chunked", vision: VisionTower | None = None,
                 vocab_rows: tuple[int, int] | None = None, mtp_draft_vocab: int | None = None):
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"NumpyRunner computes in float32 or float64, not {self.dtype}")
        if gdn_prefill_form not in ("chunked", "recurrent"):
            raise ValueError(f"gdn_prefill_form must be 'chunked' or 'recurrent', "
                             f"got {gdn_prefill_form!r}")
        for name, value in (("num_pages", num_pages), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if mtp_weights is not None and config.mtp_num_hidden_layers < 1:
            raise ValueError("MTP weights given but the config has mtp_num_hidden_layers = 0")
        self.config = config
        self.vocab_size = config.vocab_size
        self.num_pages = int(num_pages)
        self.num_slots = int(num_slots)
        self.gdn_prefill_form = gdn_prefill_form
        self.text = bind_text(config, weights, self.dtype, vocab_rows)
        self.mtp = bind_mtp(config, mtp_weights, self.dtype) if mtp_weights is not None else None
        self.mtp_layers = len(self.mtp.layers) if self.mtp is not None else 0
        self.mtp_draft_vocab = checked_draft_vocab(mtp_draft_vocab, self.vocab_size)
        self.device_bytes = 0  # host arrays only
        # With MTP loaded: each slot's latest row's hidden states, read by `mtp_draft`.
        self.drafter = (MtpDrafter(self.mtp_prefill, self.mtp_decode, vocab_size=self.vocab_size,
                                   num_pages=self.num_pages, draft_vocab=self.mtp_draft_vocab)
                        if self.mtp is not None else None)
        if vision is not None and config.mrope_section is None:
            raise ValueError("a vision tower needs a text config with MRoPE (mrope_section)")
        self.vision = MediaEmbedder(vision) if vision is not None else None
        self.layout = BatchLayout(
            config, num_pages=self.num_pages, num_slots=self.num_slots, dtype=self.dtype,
            spatial_merge_size=vision.config.spatial_merge_size if vision is not None else None)

        # Compact state indices: the n-th linear layer owns recurrent/conv state n, the n-th
        # attention layer owns KV array n; MTP layers follow the main attention layers.
        self._state_index = {layer: n for n, layer in enumerate(config.linear_layers)}
        self._kv_index = {layer: n for n, layer in enumerate(config.attention_layers)}
        self._mtp_kv_base = len(config.attention_layers)
        num_kv = len(config.attention_layers) + (len(self.mtp.layers) if self.mtp else 0)
        num_linear = len(config.linear_layers)
        c = config
        self.recurrent_states = np.zeros(
            (num_linear, num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
             c.linear_value_head_dim), self.dtype)
        self.conv_states = np.zeros(
            (num_linear, num_slots, c.linear_conv_kernel_dim - 1, c.conv_dim), self.dtype)
        kv_shape = (num_kv, num_pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim)
        self.key_pages = np.zeros(kv_shape, self.dtype)
        self.value_pages = np.zeros(kv_shape, self.dtype)

    @classmethod
    def from_artifact(cls, path_or_artifact: Any, *, num_pages: int, num_slots: int,
                      dtype: Any = np.float32, mtp: bool = False, vision: bool = False,
                      gdn_prefill_form: str = "chunked", mtp_draft_vocab: int | None = None) -> "NumpyRunner":
        """Build from a `.infernix` file (path) or an already opened artifact.

        Tensors are dequantized to float32 by the reader (`component.f32(name)`), then cast to
        `dtype`. With mtp=True the artifact's `mtp` component is loaded too, with vision=True
        its `vision` component (the tower).
        """
        from runtime.artifact import open_artifact

        opened = isinstance(path_or_artifact, (str, os.PathLike))
        if opened:
            artifact = open_artifact(path_or_artifact, components=(
                "text", *(("mtp",) if mtp else ()), *(("vision",) if vision else ())))
        else:
            artifact = path_or_artifact
        try:
            text = artifact.component("text")
            config = ModelConfig.from_dict(text.config)
            mtp_weights = ComponentTensors(artifact.component("mtp")) if mtp else None
            tower = None
            if vision:
                component = artifact.component("vision")
                tower = VisionTower(VisionConfig.from_dict(component.config),
                                    ComponentTensors(component), dtype)
            # The runner keeps its own arrays (dequantized copies), so the file can close.
            return cls(config, ComponentTensors(text), num_pages=num_pages,
                       num_slots=num_slots, dtype=dtype, mtp_weights=mtp_weights,
                       gdn_prefill_form=gdn_prefill_form, vision=tower, mtp_draft_vocab=mtp_draft_vocab)
        finally:
            if opened:
                artifact.close()

    # --- ModelRunner protocol -----------------------------------------------------------------

    def reset_slot(self, slot: int) -> None:
        check_slot(slot, self.num_slots)
        self.recurrent_states[:, slot] = 0
        self.conv_states[:, slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        check_slot(src, self.num_slots)
        check_slot(dst, self.num_slots)
        self.recurrent_states[:, dst] = self.recurrent_states[:, src]
        self.conv_states[:, dst] = self.conv_states[:, src]

    @property
    def slot_nbytes(self) -> int:
        return (self.recurrent_states[:, 0].nbytes + self.conv_states[:, 0].nbytes)

    @property
    def page_nbytes(self) -> int:
        return self.key_pages[:, 0].nbytes + self.value_pages[:, 0].nbytes

    def reserve_host_copies(self, nbytes: int) -> int:
        return nbytes  # host arrays are all there is: no copy ever waits

    def host_buffer(self, nbytes: int) -> Optional[np.ndarray]:
        return None  # any array will do: the file tier allocates its own

    def save_slot(self, slot: int) -> HostTransfer:
        check_slot(slot, self.num_slots)
        return HostReady((self.recurrent_states[:, slot].copy(), self.conv_states[:, slot].copy()))

    def load_slot(self, slot: int, state: HostTransfer) -> None:
        check_slot(slot, self.num_slots)
        recurrent, conv = state.wait()
        if recurrent.shape != self.recurrent_states[:, slot].shape \
                or conv.shape != self.conv_states[:, slot].shape:
            raise ValueError("slot state does not match this runner's state shapes")
        self.recurrent_states[:, slot] = recurrent
        self.conv_states[:, slot] = conv

    def read_pages(self, pages: Sequence[int]) -> HostTransfer:
        ids = checked_pages(pages, self.num_pages)
        return HostReady((self.key_pages[:, ids].copy(), self.value_pages[:, ids].copy()))

    def write_pages(self, pages: Sequence[int], data: HostTransfer) -> None:
        ids = checked_pages(pages, self.num_pages)
        keys, values = data.wait()
        if keys.shape != self.key_pages[:, ids].shape or values.shape != keys.shape:
            raise ValueError(f"page data of shape {keys.shape} does not fit {len(ids)} pages")
        self.key_pages[:, ids] = keys
        self.value_pages[:, ids] = values

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        out = self.prefill_with_hidden(chunk)
        self._keep_hidden(chunk.slot, chunk.start_pos, out.hidden)
        return out.logits.astype(np.float32, copy=False)

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        out = self.decode_with_hidden(items)
        for b, item in enumerate(items):
            self._keep_hidden(item.slot, item.pos, out.hidden[b:b + 1])
        return out.logits.astype(np.float32, copy=False)

    def prefill_sampled(self, chunk: PrefillChunk, sampling: Any) -> np.ndarray:
        raise NotImplementedError("NumpyRunner does not sample (samples_on_device is False): the "
                                  "engine samples its logits on the host")

    def decode_sampled(self, items: Sequence[DecodeItem], sampling: Any,
                       lookahead: bool = False) -> np.ndarray:
        raise NotImplementedError("NumpyRunner does not sample (samples_on_device is False): the "
                                  "engine samples its logits on the host")

    def step(self, rows: Sequence[StepRow]) -> list[np.ndarray]:
        return [out.logits.astype(np.float32, copy=False) for out in self.step_with_hidden(rows)]

    def commit(self, slot: int, snapshot: int) -> None:
        self.copy_slot(snapshot, slot)

    def round_cost(self, drafts: int, mtp: bool) -> float:
        """A verification row runs as one decode step per token here (`step_with_hidden`)."""
        return speculative_round_cost(self.config, drafts, mtp, 1.0, self.mtp_draft_vocab)

    def step_with_hidden(self, rows: Sequence[StepRow]) -> list[StepOutput]:
        """`step`, with each row's final-normed hidden states of every token (MTP drafting).

        Exactness is by construction: the one-token rows without snapshots run together as one
        `decode` batch, a prefill row runs as `prefill` alone, and a verification row runs as
        one single-row decode step per token (the state copied forward from snapshot to
        snapshot), so every row's numbers are those of the calls it stands for.
        """
        checked_rows(rows, self.num_slots)
        for row in rows:
            tokens = checked_tokens(row.token_ids, self.vocab_size)
            check_start_pos(row.start_pos)
            checked_page_table(row.page_table, int(row.start_pos) + len(tokens), self.num_pages)
        outputs: dict[int, StepOutput] = {}
        decodes = [i for i, row in enumerate(rows) if row.num_tokens == 1 and row.snapshots is None]
        if decodes:
            out = self.decode_with_hidden([DecodeItem(rows[i].slot, int(rows[i].token_ids[0]),
                                                      int(rows[i].start_pos), rows[i].page_table,
                                                      rows[i].media)
                                           for i in decodes])
            for b, i in enumerate(decodes):
                outputs[i] = StepOutput(logits=out.logits[b:b + 1], hidden=out.hidden[b:b + 1])
        for i, row in enumerate(rows):
            if i in outputs:
                continue
            if row.snapshots is None:
                out = self.prefill_with_hidden(PrefillChunk(row.slot, row.token_ids, int(row.start_pos),
                                                            row.page_table, all_logits=_wants_more_than_last(row),
                                                            media=row.media))
                logits, hidden = out.logits, out.hidden
            else:
                logits, hidden = self._verify(row)
            outputs[i] = StepOutput(logits=logits, hidden=hidden)
        result = []
        for i, row in enumerate(rows):
            out = outputs[i]
            offsets = list(row.logit_offsets())
            # Rows computed with only their last position's logits hold one row (or want none).
            logits = out.logits[offsets] if len(out.logits) == row.num_tokens else out.logits[:len(offsets)]
            result.append(StepOutput(logits=logits, hidden=out.hidden))
            self._keep_hidden(row.slot, row.start_pos, out.hidden)
        return result

    def mtp_draft(self, rows: Sequence[MtpRow]) -> list[list[int]]:
        """The protocol's MTP call: per row, `mtp_prefill` over the catch-up positions, then
        `mtp_decode` chained on the head's own output for drafts 2..k (`MtpDrafter.draft`)."""
        if self.drafter is None:
            raise ValueError("this runner was built without MTP weights")
        return self.drafter.draft(rows)

    def _keep_hidden(self, slot: int, start_pos: int, hidden: np.ndarray) -> None:
        if self.drafter is not None:
            self.drafter.keep(slot, start_pos, hidden)

    def _verify(self, row: StepRow) -> tuple[np.ndarray, np.ndarray]:
        """A verification row as one decode step per token: the state after token i lands in
        snapshot i, read by token i + 1; the row's own slot is only read."""
        logits, hidden = [], []
        source = int(row.slot)
        for i, token in enumerate(row.token_ids):
            target = int(row.snapshots[i])
            self.copy_slot(source, target)
            out = self.decode_with_hidden([DecodeItem(target, int(token), int(row.start_pos) + i,
                                                      row.page_table, row.media)])
            logits.append(out.logits)
            hidden.append(out.hidden)
            source = target
        return np.concatenate(logits), np.concatenate(hidden)

    # --- with hidden states (MTP drafting, tests) ---------------------------------------------

    def prefill_with_hidden(self, chunk: PrefillChunk) -> StepOutput:
        tokens = checked_tokens(chunk.token_ids, self.vocab_size)
        check_slot(chunk.slot, self.num_slots)
        batch = self.layout.prefill(chunk.slot, len(tokens), chunk.start_pos, chunk.page_table,
                                    chunk.media)
        hidden = self._forward(tokens[None], batch)[0]
        rows = hidden if chunk.all_logits else hidden[-1:]
        return StepOutput(logits=self._logits(rows), hidden=hidden)

    def decode_with_hidden(self, items: Sequence[DecodeItem]) -> StepOutput:
        batch = self.layout.decode(items)
        tokens = checked_tokens([item.token_id for item in items], self.vocab_size)
        hidden = self._forward(tokens[:, None], batch)[:, 0]
        return StepOutput(logits=self._logits(hidden), hidden=hidden)

    # --- MTP head -----------------------------------------------------------------------------

    def mtp_prefill(self, hidden: np.ndarray, token_ids: Sequence[int], start_pos: int,
                    page_table: Sequence[int], *, layer: int = 0) -> StepOutput:
        """Run the MTP head over positions start_pos .. start_pos+T-1 of one sequence.

        hidden[i]: the main model's final-normed hidden state at position start_pos+i (or the
        previous MTP output when chaining); token_ids[i]: the token at position start_pos+i+1.
        Writes the MTP layer's K/V at those positions. Returns logits [T, V] predicting the
        token at start_pos+i+2, and the MTP hidden [T, H] after `mtp.norm`.
        """
        tokens = checked_tokens(token_ids, self.vocab_size)
        hidden = self._check_mtp_hidden(hidden, len(tokens))
        batch = self.layout.prefill(None, len(tokens), start_pos, page_table)
        out = self._mtp_forward(hidden[None], tokens[None], batch, layer)[0]
        return StepOutput(logits=self._logits(out), hidden=out)

    def mtp_decode(self, items: Sequence[DecodeItem], hidden: np.ndarray, *, layer: int = 0
                   ) -> StepOutput:
        """Batched one-position MTP step: item.pos is t, item.token_id is the token at t+1,
        hidden[b] the hidden state at t. Returns logits [B, V] for t+2 and MTP hidden [B, H]."""
        batch = self.layout.decode(items, check_slots=False)
        tokens = checked_tokens([item.token_id for item in items], self.vocab_size)
        hidden = self._check_mtp_hidden(hidden, len(items))
        out = self._mtp_forward(hidden[:, None], tokens[:, None], batch, layer)[:, 0]
        return StepOutput(logits=self._logits(out), hidden=out)

    def _check_mtp_hidden(self, hidden: np.ndarray, rows: int) -> np.ndarray:
        hidden = np.asarray(hidden, dtype=self.dtype)
        if hidden.shape != (rows, self.config.hidden_size):
            raise ValueError(f"MTP hidden states must be [{rows}, {self.config.hidden_size}], "
                             f"got {list(hidden.shape)}")
        return hidden

    # --- the forward pass ---------------------------------------------------------------------

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [N, H] -> logits [N, V]: the step's main cost for a real vocabulary.

        OpenBLAS runs one row as a GEMV that streams `lm_head_t` once (about 14 ms for
        248320 x 256 on one core here) but two or three rows as a GEMM that packs it first
        (about 35-40 ms), so up to two rows go one by one.
        """
        if len(hidden) > 2:
            return hidden @ self.text.lm_head_t
        rows = [row @ self.text.lm_head_t for row in hidden]
        return rows[0][None] if len(rows) == 1 else np.stack(rows)

    def _forward(self, tokens: np.ndarray, batch: Batch) -> np.ndarray:
        """Tokens [B, T] -> final-normed hidden states [B, T, H]; updates all states."""
        eps = self.config.rms_norm_eps
        x = self.text.embed[tokens]
        if any(batch.media):
            x = self.vision.place(x, tokens, batch.positions, batch.media)
        for index, layer in enumerate(self.text.layers):
            h = ref.rms_norm(x, layer.input_norm, eps)
            if self.config.layer_types[index] == LINEAR_ATTENTION:
                x = x + self._reduce(self._gdn(layer.mixer, h, self._state_index[index], batch))
            else:
                x = x + self._reduce(self._attention(layer.mixer, h, self._kv_index[index], batch))
            x = x + self._reduce(self._mlp(layer, ref.rms_norm(x, layer.post_norm, eps)))
        return ref.rms_norm(x, self.text.norm, eps)

    def _reduce(self, partial: np.ndarray) -> np.ndarray:
        """The all-reduce point after each mixer's and MLP's output projection: a
        tensor-parallel rank (`tp_reference.RankRunner`) returns the sum of every rank's
        partial output; a runner holding the whole model already has the sum."""
        return partial

    def _mtp_forward(self, hidden: np.ndarray, tokens: np.ndarray, batch: Batch, layer: int
                     ) -> np.ndarray:
        if self.mtp is None:
            raise ValueError("this runner was built without MTP weights")
        if not 0 <= layer < len(self.mtp.layers):
            raise ValueError(f"MTP layer {layer} out of range (the head has "
                             f"{len(self.mtp.layers)})")
        eps = self.config.rms_norm_eps
        embedded = ref.rms_norm(self.text.embed[tokens], self.mtp.pre_fc_norm_embedding, eps)
        normed = ref.rms_norm(hidden, self.mtp.pre_fc_norm_hidden, eps)
        x = np.concatenate([embedded, normed], axis=-1) @ self.mtp.fc.T
        weights = self.mtp.layers[layer]
        h = ref.rms_norm(x, weights.input_norm, eps)
        x = x + self._reduce(self._attention(weights.mixer, h, self._mtp_kv_base + layer, batch))
        x = x + self._reduce(self._mlp(weights, ref.rms_norm(x, weights.post_norm, eps)))
        return ref.rms_norm(x, self.mtp.norm, eps)

    def _gdn(self, w: GdnWeights, x: np.ndarray, index: int, batch: Batch) -> np.ndarray:
        c = self.config
        batch_size, steps, _ = x.shape
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        mixed = x @ w.in_proj_qkv.T                                        # [B, T, conv_dim]
        z = (x @ w.in_proj_z.T).reshape(batch_size, steps, hv, dv)
        g, beta = ref.gdn_gates(x @ w.in_proj_a.T, x @ w.in_proj_b.T, w.a_log, w.dt_bias)

        conv_out, window = ref.causal_conv(mixed, self.conv_states[index, batch.slots], w.conv)
        self.conv_states[index, batch.slots] = window
        key_dim = c.linear_key_dim
        q = conv_out[..., :key_dim].reshape(batch_size, steps, hk, dk)
        k = conv_out[..., key_dim:2 * key_dim].reshape(batch_size, steps, hk, dk)
        v = conv_out[..., 2 * key_dim:].reshape(batch_size, steps, hv, dv)
        q = ref.l2_normalize(q) * (dk ** -0.5)
        k = ref.l2_normalize(k)
        # Grouped value heads: value head h reads key head h // r.
        q = np.repeat(q, c.value_heads_per_key_head, axis=2)
        k = np.repeat(k, c.value_heads_per_key_head, axis=2)

        state = self.recurrent_states[index, batch.slots]                  # [B, Hv, dk, dv]
        if steps == 1:
            out, state = ref.gdn_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            out = out[:, None]
        else:
            form = ref.gdn_chunked if self.gdn_prefill_form == "chunked" else ref.gdn_recurrent
            out = np.empty_like(v)
            for b in range(batch_size):
                out[b], state[b] = form(q[b], k[b], v[b], g[b], beta[b], state[b])
        self.recurrent_states[index, batch.slots] = state

        out = ref.gated_rms_norm(out, z, w.norm, c.rms_norm_eps)
        return out.reshape(batch_size, steps, hv * dv) @ w.out_proj.T

    def _attention(self, w: AttentionWeights, x: np.ndarray, index: int, batch: Batch
                   ) -> np.ndarray:
        c = self.config
        batch_size, steps, _ = x.shape
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_and_gate = (x @ w.q_proj.T).reshape(batch_size, steps, hq, 2 * d)
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
        k = (x @ w.k_proj.T).reshape(batch_size, steps, hkv, d)
        v = (x @ w.v_proj.T).reshape(batch_size, steps, hkv, d)
        q = ref.apply_rope(ref.rms_norm(q, w.q_norm, c.rms_norm_eps), batch.cos, batch.sin)
        k = ref.apply_rope(ref.rms_norm(k, w.k_norm, c.rms_norm_eps), batch.cos, batch.sin)

        key_rows = self.key_pages[index].reshape(-1, hkv, d)               # views of the pool
        value_rows = self.value_pages[index].reshape(-1, hkv, d)
        key_rows[batch.write_rows] = k
        value_rows[batch.write_rows] = v
        out = ref.attention(q, key_rows[batch.read_rows], value_rows[batch.read_rows],
                            batch.visible)
        out = out.reshape(batch_size, steps, hq * d) * ref.sigmoid(
            gate.reshape(batch_size, steps, hq * d))
        return out @ w.o_proj.T

    def _mlp(self, layer: LayerWeights, x: np.ndarray) -> np.ndarray:
        w = layer.mlp
        if not isinstance(w, MoeWeights):
            return ref.swiglu(x, w.gate_proj, w.up_proj, w.down_proj)
        c = self.config
        flat = x.reshape(-1, x.shape[-1])
        out = ref.moe(flat, w.router, w.gate_up, w.down, w.shared_gate_proj, w.shared_up_proj,
                      w.shared_down_proj, w.shared_expert_gate, c.num_experts_per_tok,
                      renormalize=c.norm_topk_prob)
        return out.reshape(x.shape)


def _wants_more_than_last(row: StepRow) -> bool:
    return row.logit_offsets() not in ((), (row.num_tokens - 1,))
