"""Prefill speed of `CudaRunner` on the Qwen3.6-27B shape with synthetic BF16 weights.

    python -m bench.prefill --out results/ [--prompts 1024,8192] [--chunk 2048] [--gdn split|fused|both]

For each prompt length it prefills one fresh sequence (chunked by `--chunk`) and reports tok/s,
the fraction of the BF16 matrix ceiling (linear-layer FLOPs 2 * params * tokens plus causal
attention FLOPs, over the matrix rate measured in the same run with the repository's own GEMM on
an 8192 x 5120 x 17408 product), and a per-kernel breakdown of one prefill chunk (events between
eager launches). `--gdn` picks the GDN prefill kernel: `split` (what the runner uses: rows over
several CTAs, then the gated norm), `fused` (the decode kernel, the path before the split
variant), or `both` (fused first, then split, same runner and weights). Writes `prefill.json` and
prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.decode import make_runner


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
        start, end = dev.create_event(), dev.create_event()
        launch(s)
        times = []
        for _ in range(5):
            start.record(s)
            launch(s)
            end.record(s)
            end.synchronize()
            times.append(end.elapsed_ms(start) / 1e3)
        return 2 * m * n * k / sorted(times)[2]
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
    events = [dev.create_event() for _ in range(len(plan) + 1)]
    events[0].record(s)
    for i, launch in enumerate(plan):
        launch(s)
        events[i + 1].record(s)
    events[-1].synchronize()
    totals: dict[str, float] = defaultdict(float)
    for i, launch in enumerate(plan):
        totals[launch.kernel.name] += events[i + 1].elapsed_ms(events[i]) * 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def use_gdn(runner: Any, mode: str, split: tuple[Any, Any]) -> None:
    """Point the runner's prefill at the fused GDN kernel or back at the split one; drop bound plans."""
    k = runner.kernels
    k.gdn_split, k.gdn_norm = (None, None) if mode == "fused" else split
    runner._plans.clear()


def run(prompts: list[int], chunk: int, gdn: str = "split") -> dict[str, Any]:
    runner = make_runner(1, max(prompts) + 64, prefill_chunk=chunk)
    rate = matrix_rate(runner)
    split = (getattr(runner.kernels, "gdn_split", None), getattr(runner.kernels, "gdn_norm", None))
    modes = ["fused", "split"] if gdn == "both" else [gdn]
    runs = {}
    for mode in modes:
        use_gdn(runner, mode, split)
        print(f"GDN prefill kernel: {mode}", flush=True)
        runs[mode] = run_prompts(runner, prompts, chunk)
    return {"matrix_rate_tflops": rate / 1e12, "device": runner.device.describe(), "chunk": chunk,
            "gdn_split_kernels": list(split), "runs": runs}


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
        lines += ["", f"GDN prefill kernel: {mode}", "",
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prompts", default="1024,8192")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--gdn", choices=("split", "fused", "both"), default="split")
    args = ap.parse_args(argv)
    data = run([int(p) for p in args.prompts.split(",")], args.chunk, args.gdn)
    data["command"] = "python -m bench.prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill.json").write_text(json.dumps(data, indent=1))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
