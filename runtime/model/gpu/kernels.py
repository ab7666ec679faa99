"""Which compiled kernel runs each part of the forward pass (`KernelChoice`).

`KernelChoice` reads the manifest's compile-time configs and picks, for a `ModelConfig`, the
variant of every family that matches its shapes; a shape nobody compiled is an error naming the
family, the shape and the build command. Linear layers use the decode GEMV when the row count
fits one of its variants (M <= 16; up to 64 for rows whose numbers must not depend on the row
count: decode and verification) and the prefill GEMM otherwise (`linear`); FP8 and NVFP4 weights
use their format's GEMV (`linear_quantised`: 8 rows a launch, decode and verification rows of an
FP8 weight up to 32) for the same row counts and above them, where
compiled for the shape, a prefill GEMM (`quantised_prefill`: W8A8 for FP8, the weight decoded to
BF16 then the BF16 GEMM for NVFP4); `layers.Forward.linear` picks by the weight's format.
MoE layers run the `moe` family at every row count (its kernels take any M): its decode form
(logits_wide, route_up or route + up_wide, down_wide) up to MOE_DECODE_ROWS rows, its split form
(logits, route, up, down) above; prefill steps of more rows run the grouped GEMMs of `moe_grouped`
after the split form's routing where they were compiled (`moe_prefill`), and take their router
logits from an FP32-out `gemm_sm90` variant where one was compiled for the router's shape
(`moe_router_gemm`). FP8 experts (`expert_format`) run the split form with `up_fp8` /
`down_fp8` at every row count, NVFP4 experts with `up_nvfp4` / `down_nvfp4`, and prefill
dequantises each layer's stacks before the grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.cuda.errors import KernelMissing
from runtime.model.config import DENSE_MLP, MOE_MLP, ModelConfig
from runtime.model.gpu.moe_prefill import MoePrefill
from runtime.model.gpu.weights import FP8, NVFP4

GEMV_ROWS = (8, 16, 32, 64)  # the row counts (MB) of the BF16 decode GEMV's variants
PREFILL_GEMV_ROWS = 16  # the most rows a non-exact launch runs through a GEMV (more: the GEMM)
# The form each width of the BF16 decode GEMV runs in (cute_kernels/gemv.py: "r1", 16 weight rows per
# CTA, or a row-group form "rRuU" of its ROW_FORMS[MB], R x 16 rows per CTA). A row's numbers are the
# same bit for bit in every form; more row groups read the activations from L2 fewer times but hold
# more registers. `python -m bench.kernels --only gemv` times every form (the key's `_rRuU` tag); set
# the fastest here.
# Measured on the H200 (docs/performance.md, fourth device session): m32 r2u1 (2 row groups) 78-95 %
# of the copy bandwidth on the 27B shapes against 44-66 % for r1; m64 r3u1 47-56 % against 26-39 %;
# m16 r1 kept (r2u2 within 2 % on the 27B, slower on the 35B-A3B). Bit-identity checked there.
GEMV_ROW_FORMS = {8: "r1", 16: "r1", 32: "r2u1", 64: "r3u1"}
# The decode GEMV family of each quantised weight format, and the format's name in messages.
QUANTISED = {FP8: ("gemv_fp8", "fp8"), NVFP4: ("gemv_nvfp4", "nvfp4")}
# The recurrent GDN kernels (decode, verification, the prefill fallback) take the fewest column
# blocks (CTAs per value head, cute_kernels/gdn.py) that give a step at least this many CTAs, else
# the most compiled: about two per SM of an H100 / H200 (132 SMs), so batch 1 of the 27B (48 heads)
# runs 8 blocks per head and batch 8 one. `python -m bench.kernels --only gdn` times every count.
GDN_MIN_CTAS = 256

# The MoE decode form (cute_kernels/moe.py), one of the forms bench/kernels.py --only moe times:
# (gate/up kernel: "route_up" with the routing fused in, or "up_wide" after `route`; its features
# a CTA; the down_wide form). None launches the split form at every row count.
# `python -m bench.decode --moe-form ...` times forms on one runner.
MOE_DECODE_FORM: tuple[str, int, str] | None = ("route_up", 8, "r1")
MOE_DECODE_ROWS = 8  # rows up to which a MoE layer runs the decode form
# With a route_up form, steps of at least this many rows run `route` then `up_wide` (the form's
# features) in place of route_up: one launch more, but no ranking in every gate/up CTA, which
# pays once many CTAs rank (the same numbers; None: route_up at every decode row count).
MOE_UP_WIDE_ROWS: int | None = 8
# Tried and removed (tenth session, `git show f033d91:cute_kernels/moe_fused_kernel.py`): one-row
# steps through a `fused` kernel (routing, gate/up, down + combine in one launch, one CTA an SM
# meeting once through grid counters; bit for bit these forms): 23.7 us a 35B-A3B layer with PDL
# against route_up_f8_r1's 20.1, a step 2.66 ms against 2.53. Also `route_up` with the shared
# expert's loads before the PDL wait and the slots' down rows prefetched to L2: 22.2 against 20.0.

# Steps of up to 8 rows run a dense MLP's gate/up GEMV with SiLU(gate) * up as its epilogue (the
# `_m8_silu` variants, cute_kernels/_gemv_silu.py: the same numbers) where compiled, in place of the
# GEMV and `silu_mul`; False: always the two launches.
GATE_UP_SILU = True

# The decode form each quantised GEMV runs in: a tag of its family's FORMS (cute_kernels/gemv_fp8.py,
# gemv_nvfp4.py; every shape is built in every form, each passing the same numerics tests);
# `python -m bench.kernels --only gemv_q` times them side by side. Slower on the H200 on every 27B
# and A3B shape, so not taken: the L2-prefetch forms (FP8 `cvt_u8_pf2` / `pf4`, NVFP4 `pf2` / `pf4` /
# `pf8` / `pf4_h`: NVFP4 gate_up M=1 shift_u8 0.53 of the copy bandwidth, pf2 0.39; FP8 gdn_in cvt
# 0.80, cvt_u8_pf2 0.64); codes staged through a per-warp cp.async ring (removed: FP8 M = 1 160 us
# against cvt's 136, NVFP4 127 against shift_u8's 106); `cvt` with `ld.global.L2::256B` code loads
# (removed, eleventh session: 135.1 us at M = 1, 151.9 at M = 8 against 135.1 and 153.3). The FP8
# wide variants exist in `cvt` only: another FP8 choice runs exact rows 8 at a time.
GEMV_FORMS = {FP8: "cvt", NVFP4: "shift_u8"}
# The row counts (MB) of the quantised GEMVs: 8 for every format, and the wide widths
# (cute_kernels/gemv_fp8.py WIDE; FP8 builds them in the `cvt` decode only, NVFP4 in its
# WIDE_FORMS `shift_u8` and `pf4`: another GEMV_FORMS choice runs exact rows 8 at a time).
QUANTISED_GEMV_ROWS = (8, 16, 32)
# The row-group form each wide FP8 width runs in (a `rRuU` tag of gemv_fp8.WIDE[MB]: R row groups of
# 16 per CTA, U blocks in flight per warp; a row's numbers are the m8 variant's in every form). On
# the H200 (`--only gemv_q`, the five 27B shapes summed) m16 r1u2 and m32 r2u1 are the faster (32
# rows: r2u1 298 us, r1u1 396); ptxas: m16 r1u2 80 registers, r2u1 155; m32 r1u1 104-128, r2u1 178.
GEMV_FP8_ROW_FORMS = {16: "r1u2", 32: "r2u1"}
# The same choice for the wide NVFP4 widths (gemv_nvfp4.py, gemv_fp8.WIDE's forms), timed the same
# way: the same picks win (`shift_u8` at 32 rows: r2u1 303 us, r1u1 389). ptxas on the 27B shapes:
# m16 r1u2 102-106 registers, r2u1 128 (gdn_in spills 8 bytes); m32 r1u1 118-128, r2u1 173-187.
GEMV_NVFP4_ROW_FORMS = {16: "r1u2", 32: "r2u1"}


def quantised_row_forms(fmt: str) -> dict[int, str]:
    """The row-group form per wide width of a quantised format (read at call time: tests switch
    the module's dicts)."""
    return GEMV_FP8_ROW_FORMS if fmt == FP8 else GEMV_NVFP4_ROW_FORMS

# The tile form of the FP8 prefill GEMM (cute_kernels/gemm_fp8_sm90.py FORMS; every shape is built in
# every form, all giving the same numbers bit for bit): "bn128", 128 x 128 tiles, "bn160" / "bn192",
# 128 x 160 / 192 tiles, "bn160c2" / "bn192c2", the same tiles in clusters of two CTAs sharing each
# weight tile by TMA multicast. On the H200 at M = 8192 (`python -m bench.kernels --only gemm_fp8`,
# the five 27B shapes): bn128 8,719 us in all, bn160 8,471 (0.72-0.76x torch._scaled_mm), bn192c2
# and bn160c2 faster on one shape each but slower in sum; bn160 also leads on the A3B shapes. Since
# the eleventh session (scales a k-tile ahead, overlapped `d` forms; docs/performance.md has the
# table): bn128d leads on attn_qkv, gate_up, down and every A3B shape, 0.82-0.85x the peer.
GEMM_FP8_FORM = "bn128d"
# Shapes (N, K) whose FP8 GEMM runs in another form: the 27B's gdn_in and o_proj, where bn160 was the
# fastest over M = 8192 and 4 x M = 2048 together (1415 / 348 and 519 / 126 us against bn128d's
# 1464 / 351 and 542 / 123; single runs, which moved up to 10 % between calls).
GEMM_FP8_SHAPE_FORMS = {(16384, 5120): "bn160", (5120, 6144): "bn160"}


def gemm_fp8_form(n: int, k: int) -> str:
    """The tile form the FP8 GEMM of an N x K weight runs in (read at call time: tests switch
    the module's values)."""
    return GEMM_FP8_SHAPE_FORMS.get((n, k), GEMM_FP8_FORM)


# The form of the FP8 prefill's activation quantisation (cute_kernels/quantize_act.py FORMS, the same
# codes and scales bit for bit): "v4" (a warp per 128-column group, 8-byte loads) or "v8" (half a warp
# per group, 16-byte loads, 4 group pairs in flight per warp). On the H200 at M = 8192 (`python -m
# bench.kernels --only gemm_fp8`): v4 45-49 % of the copy bandwidth, v8 56-65 %.
QUANTIZE_ACT_FORM = "v8"

# Decode attention's split kernel (`KernelChoice.decode_split`): "mma", the tensor-core form
# (cute_kernels/attention_decode_mma.py, a variant per most query tokens per sequence it serves),
# or "split", the CUDA-core `attention.split`. Both write the same partials for `attention.combine`
# and follow the same split plan; `python -m bench.decode --attention-form` times either. A step
# with more tokens per sequence than any mma variant serves (a split-KV prefill chunk) runs `split`.
# "mma" by default: 1.9-2.5x the CUDA-core form on the H200 over bf16 KV (27B heads), its tests
# passed there.
DECODE_ATTENTION_FORMS = ("mma", "split")
DECODE_ATTENTION_FORM = "mma"
# Each KV format has its own mma variants (`mma_*_fp8` / `mma_*_int8` read the quantised pages).
# Timed on the H200 (`python -m bench.attention_forms --kv-dtype bf16,fp8,int8 --contexts 250000`,
# 27B heads, batch 1): 1.45x (fp8) and 1.52x (int8) the bf16-KV mma kernel, 68-71 % of the copy
# bandwidth (the 3- and 6-stage forms: no faster); tests/gpu/test_attention_decode_mma_kvq.py passed
# there. The whole 27B at 250K context, batch 1: 17.44 ms a step (fp8), 17.31 (int8), 18.58 (bf16).
# False sends quantised KV to the CUDA-core `split` form.
QUANTISED_KV_MMA = True
# The mma form over each quantised format (`attention_decode_mma.KVQ_FORMS`; "" the first one, a
# form's variants where compiled for a token count and the first form's elsewhere);
# `python -m bench.decode --kv-dtype fp8,fp8:cvt` and `bench.attention_forms` time them. On the H200
# at 250K keys, batch 1, 27B heads (split + combine, ninth device session, 198 splits): fp8 188.4 us
# (first form), cvt 163.7, k4 168.4, k4cvt 158.6; int8 169.6, k4 158.1. With the one-wave plan (66
# splits): fp8 k4cvt 135.2 (91 % of the copy bandwidth), int8 k4 135.9, bf16 242.3; the whole 27B
# step at 250K: bf16 KV 18.03 ms, fp8 k4cvt 16.45 (1.096x).
QUANTISED_KV_MMA_FORM = {"fp8": "k4cvt", "int8": "k4"}

# Programmatic dependent launch in decode and verification plans (runtime/model/gpu/pdl.py): each
# kernel built with `pdl` starts while its predecessor drains and waits for its output in the
# kernel. On the H200 (`python -m bench.decode --pdl off,on`, context 1024): the 27B's graph step
# 15.08 -> 14.79 ms at batch 1 (1.02x), the 35B-A3B's 2.64 -> 2.51 ms (1.05x).
PDL = True
# Prefill attention's `attention_wgmma` form (fused, and over key splits where that form was
# compiled over them): "wg2" (the two-warpgroup kernel in lock step) or "wg2p" (the same tiles and
# arithmetic with the softmax of one tile under the PV product of the previous one,
# cute_kernels/_attention_wgmma_overlap.py); bf16 KV only (quantised KV keeps "wg2"). On the H200,
# 8K causal, 27B heads (`python -m bench.prefill --attn-tokens 8192`): wg2 474 TFLOP/s, wg2p 490.
PREFILL_ATTENTION_FORM = "wg2p"


def _find(library: Any, family: str, **match: Any) -> str | None:
    for (fam, key), entry in sorted(library.manifest.kernels.items()):
        if fam != family:
            continue
        if all(entry.config.get(k) == v for k, v in match.items()):
            return key
    return None


def _need(library: Any, family: str, what: str, **match: Any) -> str:
    key = _find(library, family, **match)
    if key is None:
        raise KernelMissing(
            f"no {family} kernel for {what} ({', '.join(f'{k}={v}' for k, v in match.items())}) in "
            f"{library.root / 'manifest.json'}; add a variant to cute_kernels/{family}.py and run "
            f"`python build_kernels.py --arch {library.manifest.arch}`")
    return key


@dataclass(frozen=True)
class QuantisedPrefill:
    """(family, key) of a quantised linear's prefill kernels (`KernelChoice.quantised_prefill`)."""

    first: tuple[str, str]  # FP8: quantize_act (the rows to e4m3 + scales); NVFP4: dequant_nvfp4 (W to bf16)
    gemm: tuple[str, str]  # FP8: gemm_fp8_sm90; NVFP4: gemm_sm90 over the decoded weight
    tail: tuple[str, str] | None  # gemm_sm90 with the row stride N + NT for the BF16 tail (None: no tail)


@dataclass
class KernelChoice:
    """Variant keys of every kernel the runner launches for one model; None where a family is
    not needed (no GDN or no attention layers) or has an optional variant that was not built
    (then the runner takes the documented fallback). Tests and benchmarks may point a prefill
    field at another compiled variant (or None) and clear the step plans."""

    library: Any
    config: ModelConfig
    expert_format: str = "bf16"  # the MoE expert stacks' format (`WeightLayout.expert_format`)
    kv_dtype: str = "bf16"  # the KV pages' format (`runtime.model.kv_format`)

    def __post_init__(self) -> None:
        c, lib = self.config, self.library
        h = c.hidden_size
        self.norm = _need(lib, "rmsnorm", "the hidden norms", mode="zc", H=h)
        self.add_norm = _need(lib, "rmsnorm", "the residual-add norms", mode="add_zc", H=h)
        self.embedding = _find(lib, "embedding", V=c.vocab_size, H=h)  # None: gather on the host
        self.silu_mul = None
        if DENSE_MLP in c.mlp_types:
            assert c.intermediate_size is not None
            self.silu_mul = _need(lib, "silu_mul", "the MLP activation", I=c.intermediate_size)
        # MoE layers: router logits, top-k, expert gate/up, expert down + combine (cute_kernels/moe.py).
        self.moe_logits = self.moe_route = self.moe_up = self.moe_down = None
        # The decode form (MOE_DECODE_FORM): route_up, or route then up_wide.
        self.moe_logits_wide = self.moe_route_up = self.moe_up_wide = self.moe_down_wide = None
        # With route_up: decode steps of at least this many rows take route + up_wide (None: never).
        self.moe_up_wide_rows: int | None = None
        self.moe_prefill: MoePrefill | None = None  # None: prefill takes the decode kernels too
        self.moe_router_gemm = None  # the router logits of many rows by the GEMM; None: the logits kernel
        # FP8 experts: `up_fp8` / `down_fp8` in place of `up` / `down` at every row count (no
        # decode form reads fp8 yet), and the grouped GEMMs on a dequantised copy for prefill;
        # NVFP4 experts the same with `up_nvfp4` / `down_nvfp4`.
        self.moe_up_fp8 = self.moe_down_fp8 = self.moe_up_nvfp4 = self.moe_down_nvfp4 = None
        if self.expert_format not in ("bf16", FP8, NVFP4):
            raise NotImplementedError(f"MoE experts in {self.expert_format}: CudaRunner reads bf16, {FP8} and {NVFP4} "
                                      "experts")
        if MOE_MLP in c.mlp_types:
            shape = {"H": h, "E": c.num_experts, "K": c.num_experts_per_tok, "I": c.moe_intermediate_size}
            self.moe_logits = _need(lib, "moe", "the MoE router", kind="logits", H=h, E=c.num_experts)
            self.moe_route = _need(lib, "moe", "MoE top-k routing", kind="route", renorm=c.norm_topk_prob, **shape)
            self.moe_up = _need(lib, "moe", "the MoE experts' gate/up", kind="up", **shape)
            self.moe_down = _need(lib, "moe", "the MoE experts' down", kind="down", **shape)
            if self.expert_format == FP8:
                self.moe_up_fp8 = _need(lib, "moe", "the fp8 MoE experts' gate/up", kind="up_fp8", **shape)
                self.moe_down_fp8 = _need(lib, "moe", "the fp8 MoE experts' down", kind="down_fp8", **shape)
            elif self.expert_format == NVFP4:
                self.moe_up_nvfp4 = _need(lib, "moe", "the nvfp4 MoE experts' gate/up", kind="up_nvfp4", **shape)
                self.moe_down_nvfp4 = _need(lib, "moe", "the nvfp4 MoE experts' down", kind="down_nvfp4", **shape)
            else:
                self.use_moe_decode_form(MOE_DECODE_FORM, MOE_UP_WIDE_ROWS)
            self.moe_prefill = MoePrefill.find(lib, _find, c, self.expert_format)
            # fp32 logits, as the logits kernel writes them (cute_kernels/gemm_sm90.py SHAPES_F32).
            self.moe_router_gemm = _find(lib, "gemm_sm90", N=c.num_experts, K=h, out="f32")
        self.gdn = self.gdn_split = self.gdn_chunked = self.gdn_norm = self.conv = None
        self.gdn_verify = self.conv_verify = None
        self.gdn_stride = 0
        # Column blocks -> (`fused` key, `verify` key) of the recurrent GDN kernels, and the CTA
        # count `gdn_recurrent` aims for (a benchmark may lower it to 0: the one-block kernels).
        self.gdn_columns: dict[int, tuple[str, str]] = {}
        self.gdn_min_ctas = GDN_MIN_CTAS
        # PDL in decode and verification plans (a benchmark may switch it before any plan is bound).
        self.pdl = PDL
        if c.linear_layers:
            hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                              c.linear_value_head_dim)
            self.gdn = _need(lib, "gdn", "Gated DeltaNet", mode="fused", cols=1, Hk=hk, Hv=hv, dk=dk, dv=dv)
            stride = lib.manifest.kernels[("gdn", self.gdn)].config["x_stride"]
            # Verification steps (t > 1 tokens per sequence, a state snapshot per token): the
            # decode kernels' code over all positions in one launch (`layers.StepShape`).
            self.gdn_verify = _need(lib, "gdn", "Gated DeltaNet verification steps", mode="verify", cols=1, Hk=hk,
                                    Hv=hv, dk=dk, dv=dv)
            # Every column-block count compiled in both modes (the same numbers as one block).
            self.gdn_columns[1] = (self.gdn, self.gdn_verify)
            for (fam, key), entry in lib.manifest.kernels.items():
                cfg = entry.config
                if fam == "gdn" and cfg.get("mode") == "fused" and cfg.get("cols", 1) > 1 \
                        and (cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"]) == (hk, hv, dk, dv):
                    verify = _find(lib, "gdn", mode="verify", cols=cfg["cols"], Hk=hk, Hv=hv, dk=dk, dv=dv)
                    if verify is not None:
                        self.gdn_columns[cfg["cols"]] = (key, verify)
            # Prefill: the chunked (WY, tensor-core) kernel where one was compiled for the shape,
            # else the recurrent one with each head's rows over several CTAs; either writes the
            # un-normalised output and the gated norm runs as its own launch. All None (prefill
            # uses the fused decode kernel) when the norm or both prefill kernels are missing.
            split = _find(lib, "gdn", mode="split", Hk=hk, Hv=hv, dk=dk, dv=dv)
            # The fastest measured form of the chunked kernel (value columns over 2 CTAs, prefetch,
            # blocked T; docs/performance.md), else any form compiled for the shape.
            shape = {"mode": "chunked", "Hk": hk, "Hv": hv, "dk": dk, "dv": dv, "x_stride": stride}
            chunked = _find(lib, "gdn_chunked", vsplit=2, prefetch=True, tinv="blocked", **shape) \
                or _find(lib, "gdn_chunked", **shape)
            norm = _find(lib, "rmsnorm", mode="gated_x", H=dv, heads=hv, z_stride=stride)
            self.gdn_norm = norm if split or chunked else None
            self.gdn_split = split if norm else None
            self.gdn_chunked = chunked if norm else None
            conv = {"C": c.conv_dim, "x_stride": stride, "Kc": c.linear_conv_kernel_dim}
            self.conv = _need(lib, "conv1d", "the GDN conv", mode="chunk", **conv)
            self.conv_verify = _need(lib, "conv1d", "the GDN conv of verification steps", mode="verify", **conv)
            self.gdn_stride = stride
        self.prep = self.split = self.combine = self.prefill_attn = self.prefill_attn_split = None
        self.decode_attention_form = "split"
        self.decode_mma: dict[int, str] = {}
        self._decode_mma_forms: dict[tuple[int, str], str] = {}  # (most tokens, form) -> key
        self.decode_mma_form = ""
        self.attn_stride = 0
        if c.attention_layers:
            hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            kv = self.kv_dtype
            self.prep = _need(lib, "attention", f"q/k norm + RoPE + {kv} KV write", kind="prep", Hq=hq, Hkv=hkv,
                              D=d, rd=c.rotary_dim, kv=kv)
            self.split = _need(lib, "attention", f"split-KV attention over {kv} KV", kind="split", Hq=hq, Hkv=hkv,
                               D=d, kv=kv)
            self.combine = _need(lib, "attention", "attention combine", kind="combine", Hq=hq, Hkv=hkv, D=d)
            self.attn_stride = lib.manifest.kernels[("attention", self.prep)].config["x_stride"]
            self.decode_attention_form = DECODE_ATTENTION_FORM
            # The tensor-core form's variants over the pool's format (bf16, or the FP8 / INT8
            # pages it reads as codes + scales, while QUANTISED_KV_MMA is on); where none is taken,
            # `split` serves.
            self._decode_mma_forms = {(entry.config["tmax"], entry.config["form"]): key
                                      for (fam, key), entry in lib.manifest.kernels.items()
                                      if fam == "attention_decode_mma" and entry.config["kv"] == kv
                                      and (kv == "bf16" or QUANTISED_KV_MMA)
                                      and (entry.config["Hq"], entry.config["Hkv"], entry.config["D"]) == (hq, hkv, d)}
            self.use_decode_mma_form(QUANTISED_KV_MMA_FORM.get(kv, ""))
            # Prefill: a tensor-core kernel (gate fused) in place of split + combine, as (family,
            # key): the WGMMA one (128-row tiles) where compiled for this shape, else the mma.sync
            # one; None (the split-KV path) when neither was. Both take the same buffers. Quantised
            # KV: only the WGMMA kernel reads it (the mma.sync one is bf16 only).
            shape = {"kind": "fwd", "Hq": hq, "Hkv": hkv, "D": d, "x_stride": self.attn_stride}
            form = PREFILL_ATTENTION_FORM if kv == "bf16" else "wg2"  # wg2p reads bf16 pages only
            wgmma = _find(lib, "attention_wgmma", form=form, kv=kv, kv_split=None, **shape)
            mma_sync = _find(lib, "attention_prefill", **shape) if kv == "bf16" else None
            self.prefill_attn = ("attention_wgmma", wgmma) if wgmma else \
                ("attention_prefill", mma_sync) if mma_sync else None
            # Chunks past the first key split take the WGMMA kernel over key splits + the combine
            # (`Storage.prefill_kv_split`), where compiled with the fused one.
            # Over key splits always wg2 (the only form built there: attention_wgmma.KV_SPLIT_FORMS).
            self.prefill_attn_split = _find(lib, "attention_wgmma", form="wg2", kv=kv, kv_split=True, **shape) \
                if wgmma else None

        # Device sampling (decode rows): None when not compiled (the engine samples on the host).
        self.sample_candidates = _find(lib, "sampling", kind="candidates")
        self.sample_pick = _find(lib, "sampling", kind="pick")
        self.sample_ctas = 0
        if self.sample_candidates and self.sample_pick:
            cfg = lib.manifest.kernels[("sampling", self.sample_candidates)].config
            self.sample_ctas = cfg["C"]
            if c.vocab_size > cfg["C"] * cfg["threads"] * cfg["per_thread"]:  # the slices must cover V
                self.sample_candidates = None
        if not (self.sample_candidates and self.sample_pick):
            self.sample_candidates = self.sample_pick = None
            self.sample_ctas = 0

    def use_decode_attention(self, form: str) -> None:
        """Pick the decode attention form (`DECODE_ATTENTION_FORMS`) before any step is bound."""
        if form not in DECODE_ATTENTION_FORMS:
            raise ValueError(f"unknown decode attention form {form!r} (one of {', '.join(DECODE_ATTENTION_FORMS)})")
        self.decode_attention_form = form

    def use_moe_decode_form(self, form: tuple[str, int, str] | None, up_wide_rows: int | None = None) -> None:
        """Pick the BF16 MoE layers' decode form (MOE_DECODE_FORM's tuple; None: the split form at
        every row count) and, for a route_up form, the rows from which route + up_wide run instead
        (MOE_UP_WIDE_ROWS; None: never) before any step is bound. Every form computes the same
        numbers."""
        c, lib = self.config, self.library
        self.moe_logits_wide = self.moe_route_up = self.moe_up_wide = self.moe_down_wide = None
        self.moe_up_wide_rows = None
        if form is None:
            return
        if self.expert_format != "bf16":
            raise ValueError(f"MoE decode form {form!r}: the decode forms read bf16 experts, these are "
                             f"{self.expert_format}")
        gate_up, features, down = form
        if gate_up not in ("route_up", "up_wide"):
            raise ValueError(f"MoE decode form {form!r}: its gate/up kernel is route_up or up_wide")
        shape = {"H": c.hidden_size, "E": c.num_experts, "K": c.num_experts_per_tok, "I": c.moe_intermediate_size}
        self.moe_logits_wide = _need(lib, "moe", "the MoE router (decode)", kind="logits_wide", H=c.hidden_size,
                                     E=c.num_experts)
        if gate_up == "route_up":
            self.moe_route_up = _need(lib, "moe", "MoE routing fused with the experts' gate/up", kind="route_up",
                                      renorm=c.norm_topk_prob, features=features, **shape)
            self.moe_up_wide_rows = up_wide_rows
        if gate_up == "up_wide" or up_wide_rows is not None:
            self.moe_up_wide = _need(lib, "moe", "the MoE experts' gate/up (decode)", kind="up_wide",
                                     features=features, **shape)
        self.moe_down_wide = _need(lib, "moe", "the MoE experts' down (decode)", kind="down_wide", form=down, **shape)

    def use_decode_mma_form(self, form: str) -> None:
        """Pick the tensor-core decode attention's form over the pool's pages before any step is
        bound: its variants for the token counts it was compiled for, the first form's for the
        others (`decode_mma`: most tokens -> key)."""
        if form and not any(f == form for _, f in self._decode_mma_forms):
            built = sorted({f for _, f in self._decode_mma_forms if f})
            raise ValueError(f"decode attention form {form!r} was not compiled for this KV format and shape "
                             f"(compiled: {', '.join(built) or 'none'})")
        self.decode_mma = {t: self._decode_mma_forms.get((t, form), key)
                           for (t, f), key in self._decode_mma_forms.items() if f == ""}
        self.decode_mma_form = form

    def decode_split(self, t: int) -> tuple[str, str]:
        """(family, key) of the split-KV kernel for a step of t query tokens per sequence: the
        tensor-core form of the fewest tokens >= t where it is the chosen form and compiled
        (it takes T as a size), else `attention.split`."""
        if self.decode_attention_form == "mma":
            fits = sorted(n for n in self.decode_mma if n >= t)
            if fits:
                return "attention_decode_mma", self.decode_mma[fits[0]]
        return "attention", self.split

    def gdn_recurrent(self, nseq: int, verify: bool) -> str:
        """The key of the recurrent GDN kernel (`verify` mode, or `fused`) for a step of nseq
        sequences: the fewest column blocks giving nseq * Hv * blocks >= `gdn_min_ctas`, else
        the most compiled. Every count computes the same numbers bit for bit."""
        hv = self.config.linear_num_value_heads
        counts = sorted(self.gdn_columns)
        cols = next((n for n in counts if nseq * hv * n >= self.gdn_min_ctas), counts[-1])
        return self.gdn_columns[cols][1 if verify else 0]

    def linear(self, n: int, k: int, m: int, exact: bool = False) -> tuple[str, str]:
        """(family, key) of the BF16 kernel computing x[m, k] @ W[n, k]^T: the decode GEMV (in the
        width's `GEMV_ROW_FORMS` form) of the narrowest compiled row count >= m (up to 16; exact:
        up to 64, a row's numbers are the same in every GEMV variant, cute_kernels/gemv.py), else
        the GEMM."""
        lib = self.library
        for mb in GEMV_ROWS:
            if m <= mb <= (GEMV_ROWS[-1] if exact else PREFILL_GEMV_ROWS):
                key = _find(lib, "gemv", N=n, K=k, MB=mb, form=GEMV_ROW_FORMS[mb])
                if key is not None:
                    return "gemv", key
        key = _find(lib, "gemm_sm90", N=n, K=k, ld=n, out="bf16")
        if key is not None:
            return "gemm_sm90", key
        raise KernelMissing(
            f"no gemv or gemm_sm90 kernel for a {n}x{k} weight at M={m}; add the shape to "
            f"cute_kernels/gemm_sm90.py (and gemv.py) and run `python build_kernels.py`")

    def gate_up_silu(self, fmt: str, n: int, k: int) -> tuple[str, str] | None:
        """(family, key) of the decode GEMV of a fused [gate | up] weight [n, k] of format `fmt`
        with SiLU(gate) * up as its epilogue (up to 8 rows, out [M, n / 2]), or None where it
        was not compiled for the format and shape or GATE_UP_SILU is off (then the GEMV and
        `silu_mul`)."""
        if not GATE_UP_SILU or (fmt != "bf16" and fmt not in QUANTISED):
            return None
        family = "gemv" if fmt == "bf16" else QUANTISED[fmt][0]
        # A quantised one runs the decode of the form it was built from: only that form's numbers.
        base = {} if fmt == "bf16" else {"base": GEMV_FORMS[fmt]}
        key = _find(self.library, family, N=n, K=k, MB=8, silu=True, **base)
        return None if key is None else (family, key)

    def exact_block(self, n: int, k: int, fmt: str = "bf16", nt: int = 0) -> int:
        """The most rows one launch takes for rows that must get a decode step's numbers
        whatever their count (`layers.Forward.linear` with exact_rows): the widest decode GEMV
        compiled for a weight [n, k] in its width's `GEMV_ROW_FORMS` form, else 8 (the GEMM then
        runs them 8 at a time: its numbers depend on the row count beyond a tile). A quantised
        weight (`fmt`, with a BF16 tail of nt rows): the widest of its format's GEMV
        (`quantised_widths`)."""
        if fmt != "bf16":
            return self.quantised_widths(fmt, n, nt, k)[-1]
        widths = [mb for mb in GEMV_ROWS
                  if _find(self.library, "gemv", N=n, K=k, MB=mb, form=GEMV_ROW_FORMS[mb]) is not None]
        return max(widths, default=GEMV_ROWS[0])

    def quantised_widths(self, fmt: str, n: int, nt: int, k: int) -> list[int]:
        """The row counts (MB) of the quantised GEMV compiled for a weight [n, k] with a BF16 tail
        of nt rows in the runner's forms (`GEMV_FORMS`, and `quantised_row_forms` past 8 rows),
        narrowest first: always 8 (`linear_quantised` refuses a shape without it)."""
        family = QUANTISED[fmt][0]
        wide = [mb for mb in QUANTISED_GEMV_ROWS[1:]
                if _find(self.library, family, N=n, NT=nt, K=k, MB=mb, form=GEMV_FORMS[fmt],
                         rform=quantised_row_forms(fmt)[mb]) is not None]
        return [QUANTISED_GEMV_ROWS[0]] + wide

    def linear_quantised(self, fmt: str, n: int, nt: int, k: int, m: int = 8) -> tuple[str, str]:
        """(family, key) of the decode GEMV for m rows of a weight [n, k] of a quantised format
        (`FP8`, `NVFP4`) with a BF16 tail of nt rows (0: none): the narrowest compiled width
        (`quantised_widths`) that holds m rows. `layers.Forward.linear` runs more rows in blocks
        of 8 (prefill where no quantised GEMM was compiled) or of `exact_block` (decode and
        verification); every width gives a row the m8 variant's numbers bit for bit."""
        family, name = QUANTISED[fmt]
        mb = next((w for w in self.quantised_widths(fmt, n, nt, k) if w >= m), None)
        if mb is None:
            raise KernelMissing(f"no {family} kernel takes {m} rows of an {name} {n}x{k} weight; the widest "
                                f"compiled takes {self.exact_block(n, k, fmt, nt)}")
        match = {"rform": quantised_row_forms(fmt)[mb]} if mb > 8 else {}
        key = _find(self.library, family, N=n, NT=nt, K=k, MB=mb, form=GEMV_FORMS[fmt], **match)
        if key is None:
            raise KernelMissing(
                f"no {family} kernel for an {name} {n}x{k} weight" + (f" with a {nt}-row bf16 tail" if nt else "")
                + f" in the {GEMV_FORMS[fmt]} form in {self.library.root / 'manifest.json'}; add the shape to SHAPES "
                f"in cute_kernels/gemv_fp8.py "
                f"(both quantised GEMVs take them) and run `python build_kernels.py --arch "
                f"{self.library.manifest.arch}`")
        return family, key

    def quantised_prefill(self, fmt: str, n: int, nt: int, k: int) -> QuantisedPrefill | None:
        """The prefill kernels of a weight [n, k] of a quantised format with a BF16 tail of nt rows
        (`layers.Forward.quantised_gemm`), written with the row stride n + nt: FP8, the activation
        quantisation and the block-scaled FP8 GEMM (W8A8, in the shape's `gemm_fp8_form`); NVFP4, the weight decoded to BF16 and
        the BF16 GEMM (W4A16); the tail by the BF16 GEMM. None when one of them was not compiled
        for the shape (the runner then keeps the format's GEMV, 8 rows a launch)."""
        lib = self.library
        if fmt == FP8:
            first = ("quantize_act", _find(lib, "quantize_act", K=k, form=QUANTIZE_ACT_FORM))
            gemm = ("gemm_fp8_sm90", _find(lib, "gemm_fp8_sm90", N=n, NT=nt, K=k, form=gemm_fp8_form(n, k)))
        else:
            first = ("dequant_nvfp4", _find(lib, "dequant_nvfp4", K=k))
            gemm = ("gemm_sm90", _find(lib, "gemm_sm90", N=n, K=k, ld=n + nt, out="bf16"))
        tail = ("gemm_sm90", _find(lib, "gemm_sm90", N=nt, K=k, ld=n + nt, out="bf16")) if nt else None
        if first[1] is None or gemm[1] is None or (tail is not None and tail[1] is None):
            return None
        return QuantisedPrefill(first, gemm, tail)

    def required(self) -> list[tuple[str, str]]:
        """(family, key) of every non-linear kernel chosen (loaded, and so checked, at start)."""
        chosen = [("rmsnorm", self.norm), ("rmsnorm", self.add_norm), ("silu_mul", self.silu_mul),
                  ("embedding", self.embedding), ("gdn", self.gdn), ("gdn", self.gdn_split),
                  ("gdn_chunked", self.gdn_chunked), ("rmsnorm", self.gdn_norm), ("conv1d", self.conv),
                  ("gdn", self.gdn_verify), ("conv1d", self.conv_verify),
                  *[("gdn", key) for cols, pair in sorted(self.gdn_columns.items()) if cols > 1 for key in pair],
                  ("attention", self.prep), ("attention", self.split), ("attention", self.combine),
                  ("sampling", self.sample_candidates),
                  ("sampling", self.sample_pick), ("moe", self.moe_logits), ("moe", self.moe_route),
                  ("moe", self.moe_up), ("moe", self.moe_down), ("moe", self.moe_logits_wide),
                  ("moe", self.moe_route_up), ("moe", self.moe_up_wide), ("moe", self.moe_down_wide),
                  ("gemm_sm90", self.moe_router_gemm), ("moe", self.moe_up_fp8), ("moe", self.moe_down_fp8),
                  ("moe", self.moe_up_nvfp4), ("moe", self.moe_down_nvfp4)]
        if self.moe_prefill:
            chosen += self.moe_prefill.required()
        if self.prefill_attn:
            chosen.append(self.prefill_attn)
        chosen.append(("attention_wgmma", self.prefill_attn_split))
        chosen += [("attention_decode_mma", key) for _, key in sorted(self.decode_mma.items())]
        return [(family, key) for family, key in chosen if key]
