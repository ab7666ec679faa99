"""Which compiled kernel runs each part of the forward pass (`KernelChoice`).

`KernelChoice` reads the manifest's compile-time configs and picks, for a `ModelConfig`, the
variant of every family that matches its shapes; a shape nobody compiled is an error naming the
family, the shape and the build command. Linear layers use the decode GEMV when the row count
fits one of its variants (M <= 16) and the prefill GEMM otherwise (`linear`); FP8 and NVFP4
weights use their format's GEMV at every row count (`linear_quantised`); `layers.Forward.linear`
picks by the weight's format.
MoE layers run the `moe` family at every row count (its kernels take any M).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.cuda.errors import KernelMissing
from runtime.model.config import DENSE_MLP, MOE_MLP, ModelConfig
from runtime.model.gpu.weights import FP8, NVFP4

# The decode GEMV family of each quantised weight format, and the format's name in messages.
QUANTISED = {FP8: ("gemv_fp8", "fp8"), NVFP4: ("gemv_nvfp4", "nvfp4")}


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


@dataclass
class KernelChoice:
    """Variant keys of every kernel the runner launches for one model; None where a family is
    not needed (no GDN or no attention layers) or has an optional variant that was not built
    (then the runner takes the documented fallback). Tests and benchmarks may point a prefill
    field at another compiled variant (or None) and clear the step plans."""

    library: Any
    config: ModelConfig

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
        if MOE_MLP in c.mlp_types:
            shape = {"H": h, "E": c.num_experts, "K": c.num_experts_per_tok, "I": c.moe_intermediate_size}
            self.moe_logits = _need(lib, "moe", "the MoE router", kind="logits", H=h, E=c.num_experts)
            self.moe_route = _need(lib, "moe", "MoE top-k routing", kind="route", renorm=c.norm_topk_prob, **shape)
            self.moe_up = _need(lib, "moe", "the MoE experts' gate/up", kind="up", **shape)
            self.moe_down = _need(lib, "moe", "the MoE experts' down", kind="down", **shape)
        self.gdn = self.gdn_split = self.gdn_chunked = self.gdn_norm = self.conv = None
        self.gdn_verify = self.conv_verify = None
        self.gdn_stride = 0
        if c.linear_layers:
            hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                              c.linear_value_head_dim)
            self.gdn = _need(lib, "gdn", "Gated DeltaNet", mode="fused", Hk=hk, Hv=hv, dk=dk, dv=dv)
            stride = lib.manifest.kernels[("gdn", self.gdn)].config["x_stride"]
            # Verification steps (t > 1 tokens per sequence, a state snapshot per token): the
            # decode kernels' code over all positions in one launch (`layers.StepShape`).
            self.gdn_verify = _need(lib, "gdn", "Gated DeltaNet verification steps", mode="verify", Hk=hk, Hv=hv,
                                    dk=dk, dv=dv)
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
        self.prep = self.split = self.combine = self.prefill_attn = None
        self.attn_stride = 0
        if c.attention_layers:
            hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            self.prep = _need(lib, "attention", "q/k norm + RoPE + KV write", kind="prep", Hq=hq, Hkv=hkv, D=d,
                              rd=c.rotary_dim)
            self.split = _need(lib, "attention", "split-KV attention", kind="split", Hq=hq, Hkv=hkv, D=d)
            self.combine = _need(lib, "attention", "attention combine", kind="combine", Hq=hq, Hkv=hkv, D=d)
            self.attn_stride = lib.manifest.kernels[("attention", self.prep)].config["x_stride"]
            # Prefill: a tensor-core kernel (gate fused) in place of split + combine, as (family,
            # key): the WGMMA one (128-row tiles) where compiled for this shape, else the mma.sync
            # one; None (the split-KV path) when neither was. Both take the same buffers.
            shape = {"kind": "fwd", "Hq": hq, "Hkv": hkv, "D": d, "x_stride": self.attn_stride}
            wgmma = _find(lib, "attention_wgmma", form="wg2", **shape)
            mma_sync = _find(lib, "attention_prefill", **shape)
            self.prefill_attn = ("attention_wgmma", wgmma) if wgmma else \
                ("attention_prefill", mma_sync) if mma_sync else None

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

    def linear(self, n: int, k: int, m: int) -> tuple[str, str]:
        """(family, key) of the BF16 kernel computing x[m, k] @ W[n, k]^T."""
        lib = self.library
        if m <= 16:
            for mb in (8, 16):
                if m <= mb:
                    key = _find(lib, "gemv", N=n, K=k, MB=mb)
                    if key is not None:
                        return "gemv", key
        key = _find(lib, "gemm_sm90", N=n, K=k)
        if key is not None:
            return "gemm_sm90", key
        raise KernelMissing(
            f"no gemv or gemm_sm90 kernel for a {n}x{k} weight at M={m}; add the shape to "
            f"cute_kernels/gemm_sm90.py (and gemv.py) and run `python build_kernels.py`")

    def linear_quantised(self, fmt: str, n: int, nt: int, k: int) -> tuple[str, str]:
        """(family, key) of the decode GEMV for a weight [n, k] of a quantised format (`FP8`,
        `NVFP4`) with a BF16 tail of nt rows (0: none). It takes up to 8 rows;
        `layers.Forward.linear` runs more rows (prefill) 8 at a time, since there is no quantised
        GEMM yet."""
        family, name = QUANTISED[fmt]
        key = _find(self.library, family, N=n, NT=nt, K=k)
        if key is None:
            raise KernelMissing(
                f"no {family} kernel for an {name} {n}x{k} weight" + (f" with a {nt}-row bf16 tail" if nt else "")
                + f" in {self.library.root / 'manifest.json'}; add the shape to SHAPES in cute_kernels/gemv_fp8.py "
                f"(both quantised GEMVs take them) and run `python build_kernels.py --arch "
                f"{self.library.manifest.arch}`")
        return family, key

    def required(self) -> list[tuple[str, str]]:
        """(family, key) of every non-linear kernel chosen (loaded, and so checked, at start)."""
        chosen = [("rmsnorm", self.norm), ("rmsnorm", self.add_norm), ("silu_mul", self.silu_mul),
                  ("embedding", self.embedding), ("gdn", self.gdn), ("gdn", self.gdn_split),
                  ("gdn_chunked", self.gdn_chunked), ("rmsnorm", self.gdn_norm), ("conv1d", self.conv),
                  ("gdn", self.gdn_verify), ("conv1d", self.conv_verify),
                  ("attention", self.prep), ("attention", self.split), ("attention", self.combine),
                  ("sampling", self.sample_candidates),
                  ("sampling", self.sample_pick), ("moe", self.moe_logits), ("moe", self.moe_route),
                  ("moe", self.moe_up), ("moe", self.moe_down)]
        if self.prefill_attn:
            chosen.append(self.prefill_attn)
        return [(family, key) for family, key in chosen if key]
