"""Prefill speed of `CudaRunner` on the Qwen3.6-27B shape with synthetic BF16 weights.

    python -m bench.prefill --out results/ [--prompts 1024,8192] [--chunk 2048] [--gdn split|fused|both]
        [--attn split|flash|both] [--attn-tokens 8192]

For each prompt length it prefills one fresh sequence (chunked by `--chunk`) and reports tok/s,
the fraction of the BF16 matrix ceiling (linear-layer FLOPs 2 * params * tokens plus causal
attention FLOPs, over the matrix rate measured in the same run with the repository's own GEMM on
an 8192 x 5120 x 17408 product), and a per-kernel breakdown of one prefill chunk (events between
eager launches). `--gdn` picks the GDN prefill kernel: `split` (what the runner uses: rows over
several CTAs, then the gated norm), `fused` (the decode kernel, the path before the split
variant), or `both` (fused first, then split, same runner and weights). `--attn` picks the prefill
attention path the same way: `flash` (the tensor-core `attention_prefill` kernel, what the runner
uses), `split` (split-KV + combine, the path before it) or `both` (split first). When torch is
importable, the attention kernel alone is also timed against torch SDPA (flash backend) on the same
Q/K/V (contiguous, `--attn-tokens` queries at positions 0.., causal; K/V repeated to Hq heads for
SDPA). Writes `prefill.json` and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.decode import make_runner
from bench.timing import median_event_seconds, plan_breakdown_us


def linear_params(runner: Any) -> int:
    lay = runner.layout
    total = sum(s.nbytes for s in lay.all_slots() if s.kind == "linear") // 2
    return total - lay.globals["embed"].nbytes // 2 - lay.globals["lm_head"].nbytes // 2


def matrix_rate(runner: Any) -> float:
    """FLOP/s of our gemm_sm90 down-projection kernel at M = 8192 (the ceiling we run at)."""
    dev, s, lib = runner.device, runner.stream, runner.library
    m, n, k = 8192, 5120, 17408
    x, w, out = dev.mem_alloc(m * k * 2), dev.mem_alloc(n * k * 2), dev.mem_alloc(m * n * 2)
    try:
        launch = lib.kernel("gemm_sm90", "down_n5120_k17408").bind({"x": x, "w": w, "out": out}, {"M": m})
        return 2 * m * n * k / median_event_seconds(dev, s, launch)
    finally:
        for p in (x, w, out):
            dev.mem_free(p)


def chunk_breakdown(runner: Any, tokens: int) -> dict[str, float]:
    from runtime.model.runner import PrefillChunk

    dev, s = runner.device, runner.stream
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(tokens)), start_pos=0,
                                page_table=list(range(-(-tokens // 64)))))
    plan = next(p for k, p in runner._plans.items() if k[0] == "prefill" and k[1] == tokens)
    return plan_breakdown_us(dev, s, plan)


def use_gdn(runner: Any, mode: str, split: tuple[Any, Any]) -> None:
    """Point the runner's prefill at the fused GDN kernel or back at the split one; drop bound plans."""
    k = runner.kernels
    k.gdn_split, k.gdn_norm = (None, None) if mode == "fused" else split
    runner._plans.clear()


def attention_vs_sdpa(runner: Any, n: int) -> dict[str, Any]:
    """Microseconds of our prefill attention kernel and of torch SDPA (flash) for n causal queries
    over n keys on the runner's shape, same Q/K/V (median of 5, after one warm-up)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:  # noqa: BLE001 - torch is optional for the bench
        return {"error": f"torch unavailable: {exc}"}
    c, k, dev, s = runner.config, runner.kernels, runner.device, runner.stream
    key = getattr(k, "prefill_attn", None)
    if key is None:
        return {"error": "no attention_prefill kernel for this shape"}
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    kk = torch.randn(n, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    vv = torch.randn(n, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(n, k.attn_stride, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(n, hq * d, device="cuda", dtype=torch.bfloat16)
    meta = torch.arange(n, device="cuda", dtype=torch.int32)
    npg = -(-n // 64)
    table = torch.arange(npg, device="cuda", dtype=torch.int32)
    kp = torch.zeros(npg * 64, hkv, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    kp[:n], vp[:n] = kk, vv
    zeros = torch.zeros(n, device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    launch = runner.library.kernel("attention_prefill", key).bind(
        {"q": q.data_ptr(), "k_pages": kp.data_ptr(), "v_pages": vp.data_ptr(), "table": table.data_ptr(),
         "qseq": zeros.data_ptr(), "pos": meta.data_ptr(), "x": x.data_ptr(), "out": out.data_ptr()},
        {"M": n, "maxp": npg, "R": 1, "NP": npg})

    def ours_us() -> float:
        return median_event_seconds(dev, s, launch) * 1e6

    ours = ours_us()
    qt = q.permute(1, 0, 2).unsqueeze(0)
    kt = kk.permute(1, 0, 2).repeat_interleave(hq // hkv, dim=0).unsqueeze(0)
    vt = vv.permute(1, 0, 2).repeat_interleave(hq // hkv, dim=0).unsqueeze(0)
    times = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    sdpa = sorted(times)[2]
    # Our output carries the sigmoid gate: compare after dividing it out (where the gate is not tiny).
    gate = torch.sigmoid(x[:, :hq * 2 * d].view(n, hq, 2 * d)[..., d:].float())
    ours_o = out.view(n, hq, d).float() / gate
    want = ref[0].permute(1, 0, 2).float()
    rel = float((ours_o - want).norm() / want.norm())
    flops = 4 * n * n / 2 * hq * d
    return {"tokens": n, "ours_us": ours, "sdpa_flash_us": sdpa, "ours_tflops": flops / ours / 1e6,
            "sdpa_tflops": flops / sdpa / 1e6, "rel_diff_vs_sdpa": rel, "torch": torch.__version__}


def use_attn(runner: Any, mode: str, key: Any) -> None:
    """Point the runner's prefill attention at the split-KV path or the tensor-core kernel."""
    runner.kernels.prefill_attn = None if mode == "split" else key
    runner._plans.clear()


def run(prompts: list[int], chunk: int, gdn: str = "split", attn: str = "flash", attn_tokens: int = 8192
        ) -> dict[str, Any]:
    runner = make_runner(1, max(prompts + [attn_tokens]) + 64, prefill_chunk=chunk)
    rate = matrix_rate(runner)
    split = (getattr(runner.kernels, "gdn_split", None), getattr(runner.kernels, "gdn_norm", None))
    flash = getattr(runner.kernels, "prefill_attn", None)
    modes = [(g, a) for g in (["fused", "split"] if gdn == "both" else [gdn])
             for a in (["split", "flash"] if attn == "both" else [attn])]
    runs = {}
    for g, a in modes:
        use_gdn(runner, g, split)
        use_attn(runner, a, flash)
        name = f"gdn {g}, attention {a if runner.kernels.prefill_attn or a == 'split' else 'split (no kernel)'}"
        print(f"prefill kernels: {name}", flush=True)
        runs[name] = run_prompts(runner, prompts, chunk)
    use_attn(runner, "flash", flash)
    vs = attention_vs_sdpa(runner, attn_tokens) if attn_tokens else {}
    print(json.dumps({"attention_vs_sdpa": vs}), flush=True)
    return {"matrix_rate_tflops": rate / 1e12, "device": runner.device.describe(), "chunk": chunk,
            "gdn_split_kernels": list(split), "attention_prefill_kernel": flash, "runs": runs,
            "attention_vs_sdpa": vs}


def run_prompts(runner: Any, prompts: list[int], chunk: int) -> dict[str, Any]:
    from runtime.model.runner import PrefillChunk

    params = linear_params(runner)
    c = runner.config
    results = []
    rng = np.random.default_rng(0)
    for n in prompts:
        ids = rng.integers(0, c.vocab_size, n).tolist()
        pages = list(range(-(-n // 64)))
        runner.reset_slot(0)
        runner.device.synchronize()
        t0 = time.perf_counter()
        runner.prefill(PrefillChunk(slot=0, token_ids=ids, start_pos=0, page_table=pages))
        runner.device.synchronize()
        secs = time.perf_counter() - t0
        attn_flops = 4 * n * n / 2 * c.num_attention_heads * c.head_dim * len(c.attention_layers)
        flops = 2 * params * n + attn_flops
        row = {"tokens": n, "seconds": secs, "tok_s": n / secs, "tflops": flops / secs / 1e12}
        results.append(row)
        print(json.dumps(row), flush=True)
    return {"results": results, "breakdown_us": chunk_breakdown(runner, min(chunk, max(prompts)))}


def render(data: dict[str, Any]) -> str:
    rate = data["matrix_rate_tflops"]
    lines = [f"Matrix ceiling in the same run: **{rate:.0f} TFLOP/s** (our gemm_sm90, "
             f"8192 x 5120 x 17408). Prefill chunk {data['chunk']}."]
    for mode, run in data["runs"].items():
        lines += ["", f"Prefill kernels: {mode}", "",
                  "| prompt tokens | seconds | tok/s | TFLOP/s | of matrix ceiling |", "|---:|---:|---:|---:|---:|"]
        for r in run["results"]:
            lines.append(f"| {r['tokens']} | {r['seconds']:.3f} | {r['tok_s']:.0f} | {r['tflops']:.0f} | "
                         f"{100 * r['tflops'] / rate:.0f}% |")
        kernels = run["breakdown_us"]
        total = sum(kernels.values())
        lines += ["", f"One prefill chunk of {data['chunk']} tokens ({mode}): {total / 1e3:.1f} ms of kernels", "",
                  "| kernel | ms per chunk | share |", "|---|---:|---:|"]
        for name, us in list(kernels.items())[:14]:
            lines.append(f"| {name} | {us / 1e3:.2f} | {100 * us / total:.1f}% |")
    vs = data.get("attention_vs_sdpa") or {}
    if "ours_us" in vs:
        lines += ["", f"Prefill attention alone, {vs['tokens']} causal queries over as many keys (same Q/K/V):", "",
                  "| kernel | ms | TFLOP/s |", "|---|---:|---:|",
                  f"| ours (attention_prefill, gate fused) | {vs['ours_us'] / 1e3:.2f} | {vs['ours_tflops']:.0f} |",
                  f"| torch SDPA flash (torch {vs['torch']}) | {vs['sdpa_flash_us'] / 1e3:.2f} | "
                  f"{vs['sdpa_tflops']:.0f} |"]
    elif vs:
        lines += ["", f"Attention vs SDPA not run: {vs.get('error')}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prompts", default="1024,8192")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--gdn", choices=("split", "fused", "both"), default="split")
    ap.add_argument("--attn", choices=("split", "flash", "both"), default="flash")
    ap.add_argument("--attn-tokens", type=int, default=8192, help="queries for the SDPA comparison (0: skip)")
    args = ap.parse_args(argv)
    data = run([int(p) for p in args.prompts.split(",")], args.chunk, args.gdn, args.attn, args.attn_tokens)
    data["command"] = "python -m bench.prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill.json").write_text(json.dumps(data, indent=1))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
