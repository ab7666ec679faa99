"""Two sections of `bench.kernels`: `--only gemv_q`, the quantised decode GEMVs (`gemv_fp8`,
`gemv_nvfp4`) in every form they are built in (their FORMS: decode and unroll), side by side in
one run; `--only gemm_fp8`, the FP8 prefill GEMM in every tile form against torch._scaled_mm
(`bench_gemm_fp8`).

gemv_q:
For each of the 27B's five shapes and M = 1, 8 and 32 (verification steps: 8 sequences of 1 + 3
tokens), every form with room for M rows (the wide m16 / m32 variants in each row-group form:
`rform`, `kernels.quantised_row_forms`; NVFP4's in each of `gemv_nvfp4.WIDE_FORMS`) runs on the
same weights (random codes without the NaN ones, e4m3 or fp32 scales, fp32 globals, the BF16 tail
of gdn_in) and the same activations, rotating over enough weight copies that L2 cannot serve
them. A row reports the time per launch, the rate over the bytes the kernel must move (codes,
scales, globals, tail, activations in, outputs) and its fraction of the copy bandwidth measured
in the same run, and `agrees`: the largest difference of its output from the first form's
relative to the output's largest magnitude (0 when bit-identical: `cvt`/`shift` FP8 and
`lut`/`shift` NVFP4 and the prefetch forms compute the same fp32 sums; `shift_x` reorders the K
slots inside each MMA). The runner's choice is `runtime/model/gpu/kernels.py` GEMV_FORMS.
"""

from __future__ import annotations

from typing import Any

MS = (1, 8, 32)


def _weights(torch: Any, family: Any, n: int, nt: int, k: int) -> dict[str, Any]:
    """Device buffers of one weight in the family's format (names as the kernel's buffers)."""
    def codes(*shape: int) -> Any:  # e4m3 codes other than the NaNs 0x7F / 0xFF
        magnitude = torch.randint(0, 0x7F, shape, device="cuda", dtype=torch.uint8)
        return magnitude | (torch.randint(0, 2, shape, device="cuda", dtype=torch.uint8) << 7)

    if family.FAMILY == "gemv_fp8":
        w = {"w": codes(n, k), "scale": torch.rand(-(-n // 128), k // 128, device="cuda") * 1e-3}
    else:
        w = {"w": torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8), "scale": codes(n, k // 16),
             "gscale": torch.rand(n, device="cuda") * 1e-3}
    if nt:
        w["tail"] = (torch.randn(nt, k, device="cuda") * 0.05).to(torch.bfloat16)
    return w


def bench_gemv_q(b: Any, forms: tuple[str, ...] = ()) -> None:
    """forms: the decode forms to time (every form built when empty)."""
    from cute_kernels import gemv_fp8, gemv_nvfp4

    from .kernels import L2_BYTES

    torch = b.torch
    for family in (gemv_fp8, gemv_nvfp4):
        for name, n, nt, k in family.SHAPES:
            if name.startswith("tiny"):
                continue
            first = _weights(torch, family, n, nt, k)
            wbytes = sum(t.numel() * t.element_size() for t in first.values())
            copies = max(1, min(8, -(-3 * L2_BYTES // wbytes)))
            ws = [first] + [_weights(torch, family, n, nt, k) for _ in range(copies - 1)]
            reps = max(copies, 8 // copies * copies)
            variants = [v for v in family.variants() if (v.config["N"], v.config["NT"], v.config["K"]) == (n, nt, k)]
            for m in MS:
                x = (torch.randn(m, k, device="cuda")).to(torch.bfloat16)
                out = torch.empty(m, n + nt, device="cuda", dtype=torch.bfloat16)
                want = None
                for v in variants:
                    if v.config["MB"] < m or (forms and v.config["form"] not in forms):
                        continue
                    if (family.FAMILY, v.key) not in b.lib:
                        print(f"gemv_q: {family.FAMILY}/{v.key} not built, skipped", flush=True)
                        continue
                    kern = b.lib.kernel(family.FAMILY, v.key)
                    bound = [kern.bind({"x": x.data_ptr(), "out": out.data_ptr(),
                                        **{buf: t.data_ptr() for buf, t in ws[i % copies].items()}}, {"M": m})
                             for i in range(reps)]
                    out.fill_(float("nan"))
                    torch.cuda.synchronize()
                    kern.launch(b.stream, {"x": x.data_ptr(), "out": out.data_ptr(),
                                           **{buf: t.data_ptr() for buf, t in first.items()}}, {"M": m})
                    b.stream.synchronize()
                    got = out.float()
                    want = got if want is None else want
                    scale = want.abs().max().item() or 1.0
                    agrees = (got - want).abs().max().item() / scale
                    us, _ = b.compare(b.ours(bound), None)
                    form = v.config["form"] + (f"/{v.config['rform']}" if "rform" in v.config else "")
                    per_sm = b.device.blocks_per_sm(kern.function, v.block[0], kern.entry.dynamic_smem)
                    b.record(family.FAMILY, v.key, f"M={m} N={n}+{nt} K={k} form={form} "
                             f"unroll={v.config['unroll']} CTAs/SM={per_sm} agrees={agrees:.1e}", us, None, "",
                             wbytes + m * (k + n + nt) * 2)
            del ws, first


def _scaled_mm_form(torch: Any, m: int, n: int, k: int) -> tuple[str, Any]:
    """The torch._scaled_mm peer for an [m, k] x [n, k] FP8 product: blockwise (1x128 activation and
    128x128 weight scales, the same recipe as ours) where this torch takes it, else rowwise (a scale
    per row and per output column, a cheaper epilogue-only scaling). Returns (name, call())."""
    # Clamped: torch's cast to e4m3fn does not saturate (past 448 gives NaN).
    xq = (torch.randn(m, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.rand(m, k // 128, device="cuda") * 1e-3
    ws = torch.rand(n // 128, k // 128, device="cuda") * 1e-3
    forms = [("blockwise", xs.t().contiguous().t(), ws.t()), ("blockwise", xs, ws.t().contiguous()),
             ("rowwise", torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda"))]
    for name, a_scale, b_scale in forms:
        def call(a_scale: Any = a_scale, b_scale: Any = b_scale) -> Any:
            return torch._scaled_mm(xq, wq.T, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)
        try:
            call()
        except (RuntimeError, NotImplementedError, ValueError):
            continue
        return name, call
    raise RuntimeError("this torch has no torch._scaled_mm for e4m3 operands")


def gemm_fp8_forms(name: str, n: int, nt: int, k: int) -> list[tuple[str, str]]:
    """(form, key) of a shape's FP8 GEMM in every tile form it is built in, today's first."""
    from cute_kernels import gemm_fp8_sm90

    return [(form, gemm_fp8_sm90.key(name, n, nt, k, form)) for form in gemm_fp8_sm90.FORMS]


def bench_gemm_fp8(b: Any, m: int) -> None:
    """`bench.kernels --only gemm_fp8`: the FP8 prefill linear of each 27B shape at M = m: the
    block-scaled GEMM alone in every tile form (`gemm_fp8_forms`; the runner's is
    `runtime/model/gpu/kernels.py: gemm_fp8_form`), each against torch._scaled_mm (blockwise where
    this torch supports it, else rowwise; the row names which) in interleaved rounds, then the
    activation quantisation alone in each of its forms. A GEMM row's case names the form, its wave efficiency over 132 SMs
    (`gemm_fp8_sm90.wave_efficiency`) and whether its output equals the first form's bit for bit
    (`same`; the forms compute the same sums in the same order)."""
    from cute_kernels import gemm_fp8_sm90, quantize_act

    torch = b.torch
    for name, n, nt, k in gemm_fp8_sm90.SHAPES:
        if name.startswith(("tiny", "test")):
            continue
        kb = -(-k // 128)
        x = [torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8) for _ in range(2)]
        w = [torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8) for _ in range(2)]
        xs = torch.rand(m, kb, device="cuda") * 1e-3
        ws = torch.rand(-(-n // 128), kb, device="cuda") * 1e-3
        out = torch.empty(m, n + nt, device="cuda", dtype=torch.bfloat16)
        peer_name, call = _scaled_mm_form(torch, m, n, k)
        peer = b.peer([call] * 4)
        first = None
        for form, key in gemm_fp8_forms(name, n, nt, k):
            if ("gemm_fp8_sm90", key) not in b.lib:
                print(f"gemm_fp8: gemm_fp8_sm90/{key} not built, skipped", flush=True)
                continue
            kern = b.lib.kernel("gemm_fp8_sm90", key)
            bound = [kern.bind({"x": x[i % 2].data_ptr(), "w": w[i % 2].data_ptr(), "x_scale": xs.data_ptr(),
                                "w_scale": ws.data_ptr(), "out": out.data_ptr()}, {"M": m}) for i in range(4)]
            out.fill_(float("nan"))
            torch.cuda.synchronize()
            bound[0](b.stream)
            b.stream.synchronize()
            got = out[:, :n].clone().view(torch.int16)  # a copy: the next form writes over out
            first = got if first is None else first
            same = bool(torch.equal(got, first))
            us, peer_us = b.compare(b.ours(bound), peer)
            b.record("gemm_fp8_sm90", key, f"M={m} N={n} K={k} form={form} "
                     f"waves={gemm_fp8_sm90.wave_efficiency(form, m, n):.0%} same={same}", us, peer_us,
                     f"torch._scaled_mm {peer_name}", flops=2.0 * m * n * k)
        del x, w, out, first
    # The activation quantisation in each form (quantize_act.FORMS; the runner's is
    # kernels.QUANTIZE_ACT_FORM), `same`: codes and scales equal to the first form's bit for bit.
    for k in (5120, 6144, 17408):
        x = (torch.randn(m, k, device="cuda")).to(torch.bfloat16)
        q = torch.empty(m, k, device="cuda", dtype=torch.uint8)
        s = torch.empty(m, -(-k // 128), device="cuda")
        first = None
        for v in quantize_act.variants():
            if v.config["K"] != k:
                continue
            kern = b.lib.kernel("quantize_act", v.key)
            bound = [kern.bind({"x": x.data_ptr(), "q": q.data_ptr(), "scale": s.data_ptr()}, {"M": m})] * 4
            q.fill_(0xAB)
            s.fill_(float("nan"))
            torch.cuda.synchronize()
            bound[0](b.stream)
            b.stream.synchronize()
            got = (q.clone(), s.clone().view(torch.int32))
            first = got if first is None else first
            same = bool(torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]))
            us, _ = b.compare(b.ours(bound), None)
            b.record("quantize_act", v.key, f"M={m} K={k} form={v.config['form']} same={same}", us, None, "",
                     m * k * 3 + m * (k // 128) * 4)
