"""`bench.kernels --only gemv_q`: the quantised decode GEMVs (`gemv_fp8`, `gemv_nvfp4`) in every
form they are built in (their FORMS: decode and unroll), side by side in one run.

For each of the 27B's five shapes and M = 1 and 8, every form runs on the same weights (random
codes without the NaN ones, e4m3 or fp32 scales, fp32 globals, the BF16 tail of gdn_in) and the
same activations, rotating over enough weight copies that L2 cannot serve them. A row reports the
time per launch, the rate over the bytes the kernel must move (codes, scales, globals, tail,
activations in, outputs) and its fraction of the copy bandwidth measured in the same run, and
`agrees`: the largest difference of its output from the first form's relative to the output's
largest magnitude (0 when bit-identical: `cvt`/`shift` FP8 and `lut`/`shift` NVFP4 compute the
same fp32 sums; `shift_x` reorders the K slots inside each MMA). The runner's choice is
`runtime/model/gpu/kernels.py` GEMV_FORMS.
"""

from __future__ import annotations

from typing import Any

MS = (1, 8)


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


def bench_gemv_q(b: Any) -> None:
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
            forms = [v for v in family.variants() if (v.config["N"], v.config["NT"], v.config["K"]) == (n, nt, k)]
            for m in MS:
                x = (torch.randn(m, k, device="cuda")).to(torch.bfloat16)
                out = torch.empty(m, n + nt, device="cuda", dtype=torch.bfloat16)
                want = None
                for v in forms:
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
                    b.record(family.FAMILY, v.key, f"M={m} N={n}+{nt} K={k} form={v.config['form']} "
                             f"unroll={v.config['unroll']} agrees={agrees:.1e}", us, None, "",
                             wbytes + m * (k + n + nt) * 2)
            del ws, first
