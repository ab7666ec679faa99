"""The forward pass as bound launches: one builder per layer kind.

`Forward.bind` lists the launches of one step shape (`StepShape`: prefill is one sequence, decode
one token per sequence) from the embedding to the final norm, reading per-step values (token
ids, positions, KV rows, slots, page tables) from the metadata block, so the list is bound once
and launched, or captured into a graph, for every step of that shape. `Forward.lm_head` is the
head over a block of rows. Each layer is its mixer (`gdn` or `attention`), then its MLP
(`dense_mlp`, or `moe_mlp` for a mixture-of-experts layer); every projection goes through
`linear`, which picks the kernel by the weight's format and shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.model.config import LINEAR_ATTENTION, MOE_MLP
from runtime.model.gpu.collective import AllReduce, Collective
from runtime.model.gpu.kernels import MOE_DECODE_ROWS, PREFILL_GEMV_ROWS, QuantisedPrefill
from runtime.model.gpu.weights import FP8, NVFP4, Slot

QUANTISED_ROWS = 8  # rows one gemv_fp8 or gemv_nvfp4 launch takes outside exact_rows steps (their m8 variants)


@dataclass(frozen=True)
class StepShape:
    """One step shape: m rows (tokens) of nseq sequences of t tokens each (m = nseq * t); splits
    and min_split: split-KV attention's splits per query row (its grid) and fewest keys per split
    (each row's split length follows its own position: `attention.split_length`); prefill: the
    prefill kernels (GDN chunked or split form, flash attention where compiled) and in-place
    states, else the decode kernels (states read at `slots_in`, written at `slots`).

    Decode has t = 1: sequence b's states are read at `slots_in[b]` and written at `slots[b]`.
    Verification (prefill False, t > 1): rows are position-major (row p * nseq + b is sequence
    b's p-th token); sequence b's states are read at `slots_in[b]` and the state after row r is
    written at `slots[r]` (its snapshot slot). The GDN conv and recurrent step are their
    `verify` kernels, one launch each over all rows, with the decode kernels' arithmetic per
    token; every other launch takes all m rows too, and projections and the head run the decode
    GEMV in blocks of up to 64 rows (`KernelChoice.exact_block`: 32 for FP8 and NVFP4 weights;
    a row's numbers are the same in every GEMV width). So each position's numbers are those of a decode step (reading the
    snapshot the position before wrote), and each weight is read once per block.

    exact: False lets the projections of a decode-kernel step pick the kernel by row count (the
    GEMM for many rows) instead of decode GEMV blocks: the MTP head's catch-up over a prompt chunk,
    whose drafts need no bit-exactness (`gpu.mtp`).

    kv_split: a prefill chunk at or past `Storage.prefill_kv_split`: the WGMMA attention over key
    splits of `min_split` keys (`splits` of them at most) and the combine, instead of the fused
    kernel."""

    m: int
    nseq: int
    t: int
    splits: int
    min_split: int
    prefill: bool
    exact: bool = True
    kv_split: bool = False

    @property
    def exact_rows(self) -> bool:
        """Decode and verification: the decode GEMV in blocks of `KernelChoice.exact_block` rows."""
        return not self.prefill and self.exact


class Forward:
    """The model's launches: `bind(shape)` for the forward pass of a step shape, `lm_head` for the
    head over a block of rows. Built once per runner; binding happens once per shape."""

    def __init__(self, config: Any, kernels: Any, library: Any, storage: Any, layout: Any, phys_slots: int,
                 collective: Collective | None = None):
        self.config, self.kernels, self.library = config, kernels, library
        self.storage, self.layout = storage, layout
        self.phys_slots = phys_slots
        # A tensor-parallel rank's communicator (`config` and `layout` are then the rank's
        # shard); None on one GPU, where `all_reduce` launches nothing.
        self.collective = collective

    def bind(self, shape: StepShape) -> list:
        """The launches of one step shape, embedding to final norm (hidden rows in `buf["h"]`)."""
        out: list = []
        self.embedding(out, shape)
        gdn_index = attn_index = 0
        for i, layer in enumerate(self.layout.layers):
            if i == 0:
                self.norm(out, shape, layer["input_norm"])
            else:
                self.add_norm(out, shape, layer["input_norm"])
            if self.config.layer_types[i] == LINEAR_ATTENTION:
                self.gdn(out, shape, gdn_index, layer)
                gdn_index += 1
            else:
                self.attention(out, shape, attn_index, layer)
                attn_index += 1
            self.add_norm(out, shape, layer["post_norm"])
            if self.config.mlp_types[i] == MOE_MLP:
                self.moe_mlp(out, shape, layer)
            else:
                self.dense_mlp(out, shape, layer)
        self.add_norm(out, shape, self.layout.globals["norm"])
        return out

    def lm_head(self, row0: int, rows: int, exact_rows: bool = False) -> list:
        """The head over hidden rows row0 .. row0 + rows - 1 into logits rows 0 .. rows - 1
        (exact_rows: in decode GEMV blocks, as `StepShape.exact_rows`)."""
        out: list = []
        head = self.layout.globals.get("lm_head") or self.layout.globals["embed"]
        buf = self.storage.buf
        self.linear(out, buf["h"] + row0 * self.config.hidden_size * 2, head, buf["logits"], rows,
                    exact_rows=exact_rows)
        return out

    # ------------------------------------------------------------------ helpers

    def launch(self, out: list, family: str, key: str, bufs: dict, sizes: dict) -> None:
        out.append(self.library.kernel(family, key).bind(bufs, sizes))

    def all_reduce(self, out: list, rows: int) -> None:
        """Sum the ranks' partial delta rows (the output of a row-parallel projection) in place,
        before `add_norm` adds them to the residual. Nothing on one GPU."""
        if self.collective is not None:
            out.append(AllReduce(self.collective, self.storage.buf["delta"], rows * self.config.hidden_size,
                                 "bf16"))

    def w(self, slot: Slot) -> int:
        return self.storage.weights_base + slot.offset

    def scales(self, slot: Slot) -> dict[str, int]:
        """The scale buffers a kernel of the slot's format takes beside its codes: FP8 the block
        scales, NVFP4 those and the per-row globals, BF16 none."""
        base = self.storage.weights_base
        if slot.format == FP8:
            return {"scale": base + slot.scale_offset}
        if slot.format == NVFP4:
            return {"scale": base + slot.scale_offset, "gscale": base + slot.gscale_offset}
        return {}

    def linear(self, out: list, x: int, weight: Slot, y: int, rows: int, tail: Slot | None = None,
               exact_rows: bool = False) -> None:
        """y[rows, N] = x[rows, K] @ weight[N, K]^T with the kernel for the weight's format and
        shape: BF16, the GEMV for a few rows, the GEMM otherwise (exact_rows: the decode GEMV
        in blocks of `KernelChoice.exact_block` rows, whatever `rows` is, so a row's numbers do
        not depend on how many there are); FP8 and NVFP4, `quantised_gemm` for more than
        PREFILL_GEMV_ROWS rows outside exact_rows steps where its kernels were compiled, else the
        format's GEMV, 8 rows a launch, or in blocks of `KernelChoice.exact_block` rows in
        exact_rows steps (FP8's wide variants, up to 32 rows: a verification step reads each
        weight once per block, not once per 8 rows; each row gets the m8 numbers); block scales,
        and NVFP4's per-row global scales, bound; `tail`, a BF16 slot after the quantised rows,
        computed by the same launch; y is then N + NT wide."""
        if weight.format in (FP8, NVFP4) and rows > PREFILL_GEMV_ROWS and not exact_rows:
            n, k = weight.shape
            prefill = self.kernels.quantised_prefill(weight.format, n, tail.shape[0] if tail else 0, k)
            if prefill is not None:
                self.quantised_gemm(out, x, weight, y, rows, tail, prefill)
                return
        if weight.format in (FP8, NVFP4):
            n, k = weight.shape
            nt = tail.shape[0] if tail else 0
            bufs = {"w": self.w(weight), **self.scales(weight)}
            if tail:
                bufs["tail"] = self.w(tail)
            block = self.kernels.exact_block(n, k, weight.format, nt) if exact_rows else QUANTISED_ROWS
            for r0 in range(0, rows, block):
                m = min(block, rows - r0)
                family, key = self.kernels.linear_quantised(weight.format, n, nt, k, m)
                self.launch(out, family, key, {**bufs, "x": x + r0 * k * 2, "out": y + r0 * (n + nt) * 2}, {"M": m})
            return
        if tail is not None or weight.format != "bf16":
            raise NotImplementedError(f"no linear kernel for {weight.format} weights ({weight.parts[0][0]}); "
                                      "CudaRunner runs bf16 weights only so far")
        n, k = weight.shape
        block = self.kernels.exact_block(n, k) if exact_rows else rows
        for r0 in range(0, rows, block):
            m = min(block, rows - r0)
            family, key = self.kernels.linear(n, k, m, exact=exact_rows)
            self.launch(out, family, key, {"x": x + r0 * k * 2, "w": self.w(weight), "out": y + r0 * n * 2},
                        {"M": m})

    def quantised_gemm(self, out: list, x: int, weight: Slot, y: int, rows: int, tail: Slot | None,
                       prefill: QuantisedPrefill) -> None:
        """y[rows, :N] = x @ dequant(weight)^T for a prefill piece (`KernelChoice.quantised_prefill`):
        FP8 as W8A8, the rows quantised to e4m3 with a scale per (row, 128 columns) (`quantize_act`)
        then the block-scaled FP8 GEMM (`gemm_fp8_sm90`); NVFP4 as W4A16, the weight decoded to
        bf16 (`dequant_nvfp4`, code x block scale x global, rounded once) into a scratch the size of
        the largest NVFP4 linear, then the BF16 GEMM. A BF16 `tail` by the BF16 GEMM into columns
        N .. N + NT of the same rows (row stride N + NT).

        Which rows take it (`linear`): more than PREFILL_GEMV_ROWS rows outside exact_rows steps,
        the rule the BF16 GEMM follows, and it keeps that rule's guarantee: a row's numbers never
        depend on the other rows of its launch (FP8: its scales are its own; both GEMMs sum each
        output in a fixed order over the k-tiles), so a prompt's rows get the same numbers however
        it is chunked as long as each piece takes the GEMM, and every piece between block
        boundaries has 64 or more rows (docs/prefix_cache.md, Exactness). Decode, verification and
        pieces of up to 16 rows (a prompt's last few tokens) keep the GEMV (W8A16 / W4A16): other
        numbers, as the BF16 GEMV's differ from the BF16 GEMM's."""
        n, k = weight.shape
        buf, base = self.storage.buf, self.storage.weights_base
        if weight.format == FP8:
            self.launch(out, *prefill.first, {"x": x, "q": buf["fp8_x"], "scale": buf["fp8_scale"]}, {"M": rows})
            self.launch(out, *prefill.gemm, {"x": buf["fp8_x"], "w": self.w(weight), "x_scale": buf["fp8_scale"],
                                             "w_scale": base + weight.scale_offset, "out": y}, {"M": rows})
        else:
            self.launch(out, *prefill.first, {"w": self.w(weight), **self.scales(weight), "out": buf["nvfp4_w"]},
                        {"N": n})
            self.launch(out, *prefill.gemm, {"x": x, "w": buf["nvfp4_w"], "out": y}, {"M": rows})
        if tail:
            self.launch(out, *prefill.tail, {"x": x, "w": self.w(tail), "out": y + n * 2}, {"M": rows})

    # ------------------------------------------------------------------ layer kinds

    def embedding(self, out: list, shape: StepShape) -> None:
        """The token rows into the residual (gathered on the host where no kernel was built)."""
        st = self.storage
        if self.kernels.embedding:
            self.launch(out, "embedding", self.kernels.embedding,
                        {"ids": st.meta_ptr("ids"), "table": self.w(self.layout.globals["embed"]),
                         "out": st.buf["resid"], "err": st.meta_ptr("err")}, {"M": shape.m})

    def norm(self, out: list, shape: StepShape, weight: Slot) -> None:
        """h = norm(resid)."""
        buf = self.storage.buf
        self.launch(out, "rmsnorm", self.kernels.norm, {"x": buf["resid"], "w": self.w(weight), "out": buf["h"]},
                    {"M": shape.m})

    def add_norm(self, out: list, shape: StepShape, weight: Slot) -> None:
        """resid += delta; h = norm(resid)."""
        buf = self.storage.buf
        self.launch(out, "rmsnorm", self.kernels.add_norm, {"x": buf["delta"], "residual": buf["resid"],
                                                            "w": self.w(weight), "out": buf["h"]}, {"M": shape.m})

    def gdn(self, out: list, shape: StepShape, n: int, layer: dict[str, Slot]) -> None:
        """The n-th Gated DeltaNet mixer: projection, causal conv, delta rule, gated norm, out."""
        k, st, buf = self.kernels, self.storage, self.storage.buf
        m, nseq, t, prefill, slots = shape.m, shape.nseq, shape.t, shape.prefill, self.phys_slots
        exact = shape.exact_rows
        self.linear(out, buf["h"], layer["w_in"], buf["proj"], m, layer.get("w_in_tail"), exact_rows=exact)
        gdn_args = {"a_log": self.w(layer["a_log"]), "dt_bias": self.w(layer["dt_bias"]), "state": st.states[n]}
        if prefill:
            # The old windows come from a scratch copy (the step copies them there: the conv
            # kernel's writers and readers differ when a piece is longer than one thread's tokens).
            self.launch(out, "conv1d", k.conv, {"x": buf["proj"], "w": self.w(layer["conv"]),
                                                "win_in": buf["win_scratch"] + n * st.win_slot_bytes,
                                                "win_out": st.windows[n], "slots_in": st.meta_ptr("slots_in"),
                                                "slots_out": st.meta_ptr("slots"), "out": buf["conv_out"]},
                        {"B": nseq, "T": t, "NI": 1, "NO": slots})
            gdn_args.update(qkv=buf["conv_out"], x=buf["proj"], slots=st.meta_ptr("slots"))
            if k.gdn_chunked or k.gdn_split:
                # The chunked or split kernel (un-normalised o into gdn_out), then the gated norm
                # in place, z read from the projection rows.
                family, key = ("gdn_chunked", k.gdn_chunked) if k.gdn_chunked else ("gdn", k.gdn_split)
                self.launch(out, family, key, {**gdn_args, "out": buf["gdn_out"]}, {"B": nseq, "T": t, "NS": slots})
                self.launch(out, "rmsnorm", k.gdn_norm, {"x": buf["gdn_out"], "z": buf["proj"],
                                                         "w": self.w(layer["gdn_norm"]), "out": buf["gdn_out"]},
                            {"M": m * self.config.linear_num_value_heads})
            else:
                self.launch(out, "gdn", k.gdn_recurrent(nseq, False),
                            {**gdn_args, "slots_out": st.meta_ptr("slots"), "norm_w": self.w(layer["gdn_norm"]),
                             "out": buf["gdn_out"]},
                            {"B": nseq, "T": t, "NS": slots})
        else:
            # Decode (t = 1; states read at slots_in and written at slots: the same slot, or a
            # spare for a step computed ahead) and verification (the `verify` kernels: each
            # row's state and window written to its snapshot slot, see `StepShape`).
            verify = t > 1
            slots_in, slots_out = st.meta_ptr("slots_in"), st.meta_ptr("slots")
            if verify:
                self.launch(out, "conv1d", k.conv_verify, {"x": buf["proj"], "w": self.w(layer["conv"]),
                                                           "win": st.windows[n], "slots_in": slots_in,
                                                           "slots_out": slots_out, "out": buf["conv_out"]},
                            {"B": nseq, "T": t, "NS": slots})
            else:
                self.launch(out, "conv1d", k.conv, {"x": buf["proj"], "w": self.w(layer["conv"]),
                                                    "win_in": st.windows[n], "win_out": st.windows[n],
                                                    "slots_in": slots_in, "slots_out": slots_out,
                                                    "out": buf["conv_out"]},
                            {"B": nseq, "T": 1, "NI": slots, "NO": slots})
            self.launch(out, "gdn", k.gdn_recurrent(nseq, verify),
                        {**gdn_args, "qkv": buf["conv_out"], "x": buf["proj"], "slots": slots_in,
                         "slots_out": slots_out, "norm_w": self.w(layer["gdn_norm"]), "out": buf["gdn_out"]},
                        {"B": nseq, "T": t, "NS": slots})
        self.linear(out, buf["gdn_out"], layer["out_proj"], buf["delta"], m, exact_rows=exact)
        self.all_reduce(out, m)

    def attention(self, out: list, shape: StepShape, n: int, layer: dict[str, Slot]) -> None:
        """The n-th gated attention mixer: projection, q/k norm + RoPE + KV write, attention over
        the paged KV with the sigmoid gate, out."""
        k, st, buf = self.kernels, self.storage, self.storage.buf
        m = shape.m
        pad_pages = st.num_pages + 1  # the pad page padded decode rows write into
        self.linear(out, buf["h"], layer["w_qkv"], buf["proj"], m, exact_rows=shape.exact_rows)
        rope = "rope_pos" if "rope_pos" in st.meta_off else "pos"  # a runner with media (`vision_rows`)
        pages = {"k_pages": st.k_pages[n], "v_pages": st.v_pages[n]}
        self.launch(out, "attention", k.prep, {"x": buf["proj"], "qn_w": self.w(layer["q_norm"]),
                                               "kn_w": self.w(layer["k_norm"]), "cos": buf["cos"], "sin": buf["sin"],
                                               "pos": st.meta_ptr(rope), "wrow": st.meta_ptr("wrow"),
                                               "q_out": buf["q"], **pages},
                    {"M": m, "P": st.rope_rows, "NP": pad_pages})
        rows = {"table": st.meta_ptr("table"), "qseq": st.meta_ptr("qseq"), "pos": st.meta_ptr("pos")}
        if shape.prefill and k.prefill_attn and not shape.kv_split:
            self.launch(out, *k.prefill_attn,
                        {"q": buf["q"], **pages, **rows, "x": buf["proj"], "out": buf["attn_out"]},
                        {"M": m, "maxp": st.maxp, "R": st.max_batch, "NP": pad_pages})
        else:
            partials = {"q": buf["q"], **pages, **rows, "o_part": buf["o_part"], "lse": buf["lse"]}
            if shape.kv_split:
                self.launch(out, "attention_wgmma", k.prefill_attn_split, partials,
                            {"M": m, "S": shape.splits, "split": shape.min_split, "maxp": st.maxp,
                             "R": st.max_batch, "NP": pad_pages})
            else:
                family, split = k.decode_split(shape.t)
                # The tensor-core form serves a sequence's t tokens (rows position-major) in one CTA.
                tokens = {"T": shape.t} if family == "attention_decode_mma" else {}
                self.launch(out, family, split, partials,
                            {"M": m, "S": shape.splits, "min_split": shape.min_split, "maxp": st.maxp,
                             "R": st.max_batch, "NP": pad_pages, **tokens})
            self.launch(out, "attention", k.combine, {"o_part": buf["o_part"], "lse": buf["lse"],
                                                      "pos": st.meta_ptr("pos"), "x": buf["proj"],
                                                      "out": buf["attn_out"]},
                        {"M": m, "S": shape.splits, "min_split": shape.min_split})
        self.linear(out, buf["attn_out"], layer["o_proj"], buf["delta"], m, exact_rows=shape.exact_rows)
        self.all_reduce(out, m)

    def dense_mlp(self, out: list, shape: StepShape, layer: dict[str, Slot]) -> None:
        """h -> delta through gate/up, SiLU(gate) * up, down: a step of up to 8 rows, which runs the
        m8 GEMV for gate/up whatever its kind, in one launch for the first two where compiled
        (`KernelChoice.gate_up_silu`: the same numbers)."""
        buf = self.storage.buf
        exact = shape.exact_rows
        gate_up = layer["w_gate_up"]
        fused = None if shape.m > 8 else self.kernels.gate_up_silu(gate_up.format, *gate_up.shape)
        if fused is not None:
            self.launch(out, *fused, {"x": buf["h"], "w": self.w(gate_up), **self.scales(gate_up), "out": buf["act"]},
                        {"M": shape.m})
        else:
            self.linear(out, buf["h"], gate_up, buf["proj"], shape.m, exact_rows=exact)
            self.launch(out, "silu_mul", self.kernels.silu_mul, {"x": buf["proj"], "out": buf["act"]},
                        {"M": shape.m})
        self.linear(out, buf["act"], layer["down"], buf["delta"], shape.m, exact_rows=exact)
        self.all_reduce(out, shape.m)

    def moe_mlp(self, out: list, shape: StepShape, layer: dict[str, Slot]) -> None:
        """h -> delta through the router logits, top-k routing (plus the shared expert's gate), the
        experts' gate/up + SwiGLU and their down projections weighted and summed per row
        (cute_kernels/moe.py). Every launch takes all m rows: each row's experts come from the
        device (no host read, so the step captures in a graph) and each row is reduced on its own,
        in a fixed order, so a row's numbers do not depend on the others (prefill included).
        Up to MOE_DECODE_ROWS rows the decode form runs (staged loads; with route_up, the routing
        fused into gate/up, up to MOE_UP_WIDE_ROWS rows), above it the split form; all compute the
        same numbers. Rows that need
        not be exact (a prefill chunk, an MTP catch-up) above MOE_DECODE_ROWS take their router
        logits from the FP32-out GEMM (`moe_router_gemm`, where compiled): the same fp32 products
        summed in another order, so a logit may differ in its last bits from the logits kernel's
        and a near-tie may route differently from the same row at decode; the routing of given
        logits is the same kernel. FP8 expert stacks take the split form with `up_fp8` /
        `down_fp8` at every row count (NVFP4 ones with `up_nvfp4` / `down_nvfp4`), and such rows
        the grouped GEMMs on a dequantised copy (`gpu.moe_prefill`)."""
        k, buf, m = self.kernels, self.storage.buf, shape.m
        route = {"ids": buf["moe_ids"], "wts": buf["moe_wts"]}
        decode = k.moe_down_wide is not None and m <= MOE_DECODE_ROWS
        gate_up, experts_down = self.w(layer["experts_gate_up"]), self.w(layer["experts_down"])
        # FP8 stacks: their kernels take the block scales too (`KernelChoice.moe_up_fp8`); NVFP4
        # stacks the block scales and the per-row globals (`KernelChoice.moe_up_nvfp4`).
        fmt = layer["experts_gate_up"].format
        quantised = fmt in (FP8, NVFP4)
        up_key, down_key, scales = k.moe_up, k.moe_down, ({}, {})
        if quantised:
            up_key, down_key = (k.moe_up_fp8, k.moe_down_fp8) if fmt == FP8 else (k.moe_up_nvfp4, k.moe_down_nvfp4)
            scales = (self.scales(layer["experts_gate_up"]), self.scales(layer["experts_down"]))
        logits = {"x": buf["h"], "w": self.w(layer["router"]), "out": buf["moe_logits"]}
        if not decode and not shape.exact_rows and k.moe_router_gemm:
            # Many rows of a prefill chunk or MTP catch-up: the logits by the GEMM (fp32, the same
            # products summed in another order; the routing below is the same kernel).
            self.launch(out, "gemm_sm90", k.moe_router_gemm, logits, {"M": m})
        else:
            self.launch(out, "moe", k.moe_logits_wide if decode else k.moe_logits, logits, {"M": m})
        # route_up ranks the logits in every gate/up CTA: from `moe_up_wide_rows` rows, `route`
        # ranks them once and up_wide reads the ids (the same numbers).
        if decode and k.moe_route_up and (k.moe_up_wide_rows is None or m < k.moe_up_wide_rows):
            self.launch(out, "moe", k.moe_route_up, {"logits": buf["moe_logits"], "x": buf["h"],
                                                     "w_sg": self.w(layer["shared_gate"]), "w": gate_up, **route,
                                                     "act": buf["moe_act"]}, {"M": m})
        else:
            self.launch(out, "moe", k.moe_route, {"logits": buf["moe_logits"], "x": buf["h"],
                                                  "w_sg": self.w(layer["shared_gate"]), **route}, {"M": m})
            # Quantised stacks are dequantised whole for the grouped path: a step of a few rows
            # reads their experts through `up_fp8` / `down_fp8` (`up_nvfp4` / `down_nvfp4`) instead.
            if not shape.exact_rows and k.moe_prefill and not decode and not (quantised and m <= MOE_DECODE_ROWS):
                # Many rows of a prefill chunk or an MTP catch-up (not `exact`): sorted by expert and
                # run through grouped GEMMs (`gpu.moe_prefill`); the same routing, slot order and
                # final rounding as the split form.
                k.moe_prefill.bind(self, out, m, layer, route)
                self.all_reduce(out, m)
                return
            self.launch(out, "moe", k.moe_up_wide if decode else up_key,
                        {"x": buf["h"], "w": gate_up, **scales[0], "ids": route["ids"], "act": buf["moe_act"]},
                        {"M": m})
        self.launch(out, "moe", k.moe_down_wide if decode else down_key,
                    {"act": buf["moe_act"], "w": experts_down, **scales[1], **route, "out": buf["delta"]}, {"M": m})
        self.all_reduce(out, m)
