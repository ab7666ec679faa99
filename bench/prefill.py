"""Prefill speed of `CudaRunner` on a released model's shape with synthetic weights.

    python -m bench.prefill --out results/ [--prompts 1024,8192] [--chunk 2048]
        [--gdn chunked|split|fused|all] [--attn split|flash|both] [--attn-tokens 8192] [--gdn-tokens 8192]
        [--synthetic-shape qwen3.6-27b|qwen3.6-35b-a3b|qwen3-next-80b|FILE.json] [--router balanced|skewed]
        [--sweep-chunks 1024,2048,4096] [--format bf16|fp8|nvfp4]

`--format` gives the projections the format of Qwen's FP8 release or of `tools.convert --recipe
nvfp4` (as `bench.decode --format`; BF16 by default): FP8 prefill pieces of more than 16 rows run
the activation quantisation and the block-scaled FP8 GEMM, NVFP4 ones the NVFP4 path
(`layers.Forward.linear`); MoE experts in FP8 or NVFP4 are dequantised a layer at a time before
the grouped GEMMs (cute_kernels/dequant_weights.py, dequant_nvfp4.py). The FLOP rate is still reported against the BF16 matrix
ceiling.

For each prompt length it prefills one fresh sequence (chunked by `--chunk`) twice and reports
the second run (the first binds the launch plans) as tok/s and the fraction of the BF16 matrix
ceiling (linear-layer FLOPs 2 * params * tokens, for an MoE model the params a token uses: the
dense parts, the router and k + 1 experts a layer; plus causal attention FLOPs, over the matrix rate
measured in the same run with the repository's own GEMM on an 8192 x 5120 x 17408 product), with
a per-kernel breakdown of one prefill chunk (events between eager launches). `--gdn` picks the
GDN prefill kernel: `chunked` (what the runner uses: the WY tensor-core kernel), `split` (the
recurrent kernel with each head's rows over several CTAs), `fused` (the decode kernel), or `all`
(each in turn, same runner and weights). `--attn` picks the prefill attention path the same way:
`flash` (the tensor-core `attention_prefill` kernel, what the runner uses), `split` (split-KV +
combine) or `both`. When torch is importable, each compiled prefill attention kernel alone (the
mma.sync `attention_prefill` and every form of `attention_wgmma`, bf16 pages; the forms over key
splits of `BENCH_KEY_SPLIT` keys followed by the combine) is timed against torch SDPA (flash
backend) on the same Q/K/V (`--attn-tokens` causal queries; K/V repeated to Hq heads for SDPA),
and when fla is importable the GDN prefill kernels alone against fla's `chunk_gated_delta_rule`
on the same inputs (`--gdn-tokens`). Writes `prefill.json` and prints Markdown tables. `--sweep-chunks` also times each prompt prefilled the way the engine feeds a
`--prefill-chunk` of each size (one runner call per chunk, each size at most `--chunk`), which is
how the server's default chunk is chosen.
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
    """Projection weights one token multiplies by (embedding and head excluded): every linear
    slot, except that an MoE layer's expert stacks ([E + 1] experts, the shared one last) count
    only the k routed experts and the shared one."""
    lay, c = runner.layout, runner.config
    total = 0
    for layer in lay.layers:
        for role, slot in layer.items():
            if slot.kind != "linear":
                continue
            n = int(np.prod(slot.shape))
            total += n // (c.num_experts + 1) * (c.num_experts_per_tok + 1) if role.startswith("experts_") else n
    globals_ = [s for name, s in lay.globals.items() if s.kind == "linear" and name not in ("embed", "lm_head")]
    return total + sum(int(np.prod(s.shape)) for s in globals_)


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
    plan = next(p for k, p in runner.steps.plans.bound.items() if k[0] == "prefill" and k[1] == tokens)
    return plan_breakdown_us(dev, s, plan)


def use_gdn(runner: Any, mode: str, kernels: dict[str, Any]) -> None:
    """Point the runner's GDN prefill at one kernel (`chunked`, `split` or the decode kernel
    `fused`); `kernels` holds the keys the runner chose at construction. Drops bound plans."""
    k = runner.kernels
    k.gdn_chunked = kernels["gdn_chunked"] if mode == "chunked" else None
    k.gdn_split = kernels["gdn_split"] if mode == "split" else None
    k.gdn_norm = None if mode == "fused" else kernels["gdn_norm"]
    runner.steps.plans.clear()


def gdn_vs_fla(runner: Any, n: int) -> dict[str, Any]:
    """Microseconds of our GDN prefill kernels (every compiled chunked variant, split) and of fla's
    `chunk_gated_delta_rule` for one n-token sequence of one layer on the runner's shape, same
    inputs (median of 5 after a warm-up). fla gets q/k already repeated to the value heads and g,
    beta precomputed (what transformers does before calling it); ours reads the conv output and
    projection rows and computes the L2 norms, g and beta inside. Output difference: ours vs fla,
    relative L2 over the whole output."""
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        import fla
    except Exception as exc:  # noqa: BLE001 - torch / fla are optional for the bench
        return {"error": f"fla unavailable: {exc}"}
    c, k, dev, s = runner.config, runner.kernels, runner.device, runner.stream
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    cfg = runner.library.manifest.kernels[("gdn", k.gdn)].config
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(n, c.conv_dim, device="cuda", generator=g).to(torch.bfloat16)
    x = (torch.randn(n, cfg["x_stride"], device="cuda", generator=g) * 1.5).to(torch.bfloat16)
    a_log = (torch.randn(hv, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    dt_bias = (torch.randn(hv, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    state = torch.zeros(1, hv, dv, dk, device="cuda", dtype=torch.float32)
    slots = torch.zeros(1, device="cuda", dtype=torch.int32)
    out = torch.empty(n, hv * dv, device="cuda", dtype=torch.bfloat16)
    ours: dict[str, Any] = {}
    outputs = {}
    chunked = sorted(key for (fam, key), e in runner.library.manifest.kernels.items()
                     if fam == "gdn_chunked" and (e.config["Hk"], e.config["Hv"], e.config["dk"], e.config["dv"])
                     == (hk, hv, dk, dv))
    kernels = [(f"chunked {key}", "gdn_chunked", key) for key in chunked]
    if k.gdn_split:
        kernels.append(("split", "gdn", k.gdn_split))
    for name, family, key in kernels:
        launch = runner.library.kernel(family, key).bind(
            {"qkv": qkv.data_ptr(), "x": x.data_ptr(), "a_log": a_log.data_ptr(), "dt_bias": dt_bias.data_ptr(),
             "state": state.data_ptr(), "slots": slots.data_ptr(), "out": out.data_ptr()}, {"B": 1, "T": n, "NS": 1})
        # The state accumulates over the timing repeats; the time does not depend on its values.
        ours[f"{name}_us"] = median_event_seconds(dev, s, launch) * 1e6
        state.zero_()
        torch.cuda.synchronize()
        launch(s)
        s.synchronize()
        outputs[name] = out.float().clone()
    key_dim = hk * dk
    q = qkv[:, :key_dim].view(1, n, hk, dk).repeat_interleave(hv // hk, dim=2)
    kk = qkv[:, key_dim:2 * key_dim].view(1, n, hk, dk).repeat_interleave(hv // hk, dim=2)
    v = qkv[:, 2 * key_dim:].view(1, n, hv, dv)
    b = x[:, cfg["b_off"]:cfg["b_off"] + hv].float()
    a = x[:, cfg["a_off"]:cfg["a_off"] + hv].float()
    gate = (-torch.exp(a_log.float()) * torch.nn.functional.softplus(a + dt_bias.float())).view(1, n, hv)
    beta = torch.sigmoid(b).view(1, n, hv)
    times = []
    for i in range(6):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        o_fla, _ = chunk_gated_delta_rule(q, kk, v, g=gate, beta=beta, scale=dk ** -0.5, initial_state=None,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        e1.record()
        e1.synchronize()
        if i:
            times.append(e0.elapsed_time(e1) * 1e3)
    fla_us = sorted(times)[2]
    want = o_fla[0].reshape(n, hv * dv).float()
    diffs = {f"{name}_rel_diff_vs_fla": float((o - want).norm() / want.norm()) for name, o in outputs.items()}
    return {"tokens": n, **ours, "fla_us": fla_us, **diffs, "fla": getattr(fla, "__version__", "?"),
            "torch": torch.__version__}


def prefill_attention_kernels(runner: Any, key_split: bool = False) -> list[tuple[str, str]]:
    """(family, key) of every compiled prefill attention kernel over bf16 pages for the runner's
    shape: the mma.sync `attention_prefill` and each form of `attention_wgmma`; key_split: the
    `attention_wgmma` forms over key splits instead (they write the combine's partials)."""
    c, lib = runner.config, runner.library
    shape = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    return sorted((fam, key) for (fam, key), e in lib.manifest.kernels.items()
                  if fam in ("attention_prefill", "attention_wgmma") and e.config.get("kind") == "fwd"
                  and e.config.get("kv", "bf16") == "bf16" and bool(e.config.get("kv_split")) == key_split
                  and (e.config["Hq"], e.config["Hkv"], e.config["D"]) == shape)


# Keys per split when `attention_vs_sdpa` times the forms over key splits (4 splits at 8K).
BENCH_KEY_SPLIT = 2048


def attention_vs_sdpa(runner: Any, n: int) -> dict[str, Any]:
    """Microseconds of each of our prefill attention kernels (`prefill_attention_kernels`) and of
    torch SDPA (flash) for n causal queries over n keys on the runner's shape, same Q/K/V (median
    of 5, after one warm-up), with each kernel's relative difference from SDPA (its gate divided
    out)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:  # noqa: BLE001 - torch is optional for the bench
        return {"error": f"torch unavailable: {exc}"}
    c, k, dev, s = runner.config, runner.kernels, runner.device, runner.stream
    kernels = prefill_attention_kernels(runner)
    if not kernels:
        return {"error": "no prefill attention kernel for this shape"}
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
    want = ref[0].permute(1, 0, 2).float()
    # Our outputs carry the sigmoid gate: compare after dividing it out.
    gate = torch.sigmoid(x[:, :hq * 2 * d].view(n, hq, 2 * d)[..., d:].float())
    flops = 4 * n * n / 2 * hq * d
    ours = {}
    for family, key in kernels:
        launch = runner.library.kernel(family, key).bind(
            {"q": q.data_ptr(), "k_pages": kp.data_ptr(), "v_pages": vp.data_ptr(), "table": table.data_ptr(),
             "qseq": zeros.data_ptr(), "pos": meta.data_ptr(), "x": x.data_ptr(), "out": out.data_ptr()},
            {"M": n, "maxp": npg, "R": 1, "NP": npg})
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        us = median_event_seconds(dev, s, launch) * 1e6
        s.synchronize()
        ours_o = out.view(n, hq, d).float() / gate
        ours[f"{family}/{key}"] = {"us": us, "tflops": flops / us / 1e6,
                                   "rel_diff_vs_sdpa": float((ours_o - want).norm() / want.norm())}
    # The forms over key splits, each followed by the combine (which applies the gate).
    splits = -(-n // BENCH_KEY_SPLIT)
    o_part = torch.empty(n, hq, splits, d, device="cuda", dtype=torch.float32)
    lse = torch.empty(n, hq, splits, device="cuda", dtype=torch.float32)
    combine = runner.library.kernel("attention", k.combine).bind(
        {"o_part": o_part.data_ptr(), "lse": lse.data_ptr(), "pos": meta.data_ptr(), "x": x.data_ptr(),
         "out": out.data_ptr()}, {"M": n, "S": splits, "min_split": BENCH_KEY_SPLIT})
    over_splits = {}
    for family, key in prefill_attention_kernels(runner, key_split=True):
        launch = runner.library.kernel(family, key).bind(
            {"q": q.data_ptr(), "k_pages": kp.data_ptr(), "v_pages": vp.data_ptr(), "table": table.data_ptr(),
             "qseq": zeros.data_ptr(), "pos": meta.data_ptr(), "o_part": o_part.data_ptr(), "lse": lse.data_ptr()},
            {"M": n, "maxp": npg, "R": 1, "NP": npg, "S": splits, "split": BENCH_KEY_SPLIT})
        out.fill_(float("nan"))
        torch.cuda.synchronize()

        def both(stream: Any, launch: Any = launch) -> None:
            launch(stream)
            combine(stream)

        us = median_event_seconds(dev, s, both) * 1e6
        s.synchronize()
        ours_o = out.view(n, hq, d).float() / gate
        over_splits[f"{family}/{key}"] = {"us": us, "tflops": flops / us / 1e6, "split": BENCH_KEY_SPLIT,
                                          "rel_diff_vs_sdpa": float((ours_o - want).norm() / want.norm())}
    return {"tokens": n, "kernels": ours, "key_splits": over_splits, "sdpa_flash_us": sdpa,
            "sdpa_tflops": flops / sdpa / 1e6, "flops": flops, "torch": torch.__version__}


def use_attn(runner: Any, mode: str, key: Any) -> None:
    """Point the runner's prefill attention at the split-KV path or the tensor-core kernel."""
    runner.kernels.prefill_attn = None if mode == "split" else key
    runner.steps.plans.clear()


GDN_MODES = ("chunked", "split", "fused")


def run(prompts: list[int], chunk: int, gdn: str = "chunked", attn: str = "flash", attn_tokens: int = 8192,
        gdn_tokens: int = 8192, shape: str = "qwen3.6-27b", router: str = "balanced",
        sweep_chunks: list[int] | None = None, weight_format: str = "bf16") -> dict[str, Any]:
    runner = make_runner(1, max(prompts + [attn_tokens]) + 64, prefill_chunk=chunk, shape=shape, router=router,
                         weight_format=weight_format)
    rate = matrix_rate(runner)
    k = runner.kernels
    gdn_kernels = {name: getattr(k, name, None) for name in ("gdn_chunked", "gdn_split", "gdn_norm")}
    flash = getattr(k, "prefill_attn", None)
    modes = [(g, a) for g in (GDN_MODES if gdn == "all" else [gdn])
             for a in (["split", "flash"] if attn == "both" else [attn])]
    runs = {}
    for g, a in modes:
        if g != "fused" and not gdn_kernels[f"gdn_{g}"]:
            print(f"no gdn {g} kernel for this shape: skipped", flush=True)
            continue
        use_gdn(runner, g, gdn_kernels)
        use_attn(runner, a, flash)
        name = f"gdn {g}, attention {a if runner.kernels.prefill_attn or a == 'split' else 'split (no kernel)'}"
        print(f"prefill kernels: {name}", flush=True)
        runs[name] = run_prompts(runner, prompts, chunk)
    use_gdn(runner, "chunked" if gdn_kernels["gdn_chunked"] else "split", gdn_kernels)
    use_attn(runner, "flash", flash)
    sweep = chunk_sweep(runner, prompts, sweep_chunks) if sweep_chunks else []
    vs = attention_vs_sdpa(runner, attn_tokens) if attn_tokens else {}
    print(json.dumps({"attention_vs_sdpa": vs}), flush=True)
    k.gdn_chunked, k.gdn_split = gdn_kernels["gdn_chunked"], gdn_kernels["gdn_split"]
    vs_fla = gdn_vs_fla(runner, gdn_tokens) if gdn_tokens else {}
    print(json.dumps({"gdn_vs_fla": vs_fla}), flush=True)
    return {"matrix_rate_tflops": rate / 1e12, "device": runner.device.describe(), "chunk": chunk,
            "shape": shape, "router": router, "format": weight_format,
            "gdn_kernels": gdn_kernels, "attention_prefill_kernel": flash, "runs": runs,
            "attention_vs_sdpa": vs, "gdn_vs_fla": vs_fla, "chunk_sweep": sweep}


def prefill_seconds(runner: Any, ids: list[int], call: int) -> float:
    """Seconds to prefill `ids` from position 0 in runner calls of `call` tokens (each cut into the
    runner's own pieces); the second of two runs (the first binds the launch plans of every piece
    shape)."""
    from runtime.model.runner import PrefillChunk

    pages = list(range(-(-len(ids) // 64)))
    for _ in range(2):
        runner.reset_slot(0)
        runner.device.synchronize()
        t0 = time.perf_counter()
        for lo in range(0, len(ids), call):
            runner.prefill(PrefillChunk(slot=0, token_ids=ids[lo:lo + call], start_pos=lo, page_table=pages))
        runner.device.synchronize()
        secs = time.perf_counter() - t0
    return secs


def run_prompts(runner: Any, prompts: list[int], chunk: int) -> dict[str, Any]:
    params = linear_params(runner)
    c = runner.config
    results = []
    rng = np.random.default_rng(0)
    for n in prompts:
        ids = rng.integers(0, c.vocab_size, n).tolist()
        secs = prefill_seconds(runner, ids, n)  # one call: the runner's pieces of `chunk`
        attn_flops = 4 * n * n / 2 * c.num_attention_heads * c.head_dim * len(c.attention_layers)
        flops = 2 * params * n + attn_flops
        row = {"tokens": n, "seconds": secs, "tok_s": n / secs, "tflops": flops / secs / 1e12}
        results.append(row)
        print(json.dumps(row), flush=True)
    return {"results": results, "breakdown_us": chunk_breakdown(runner, min(chunk, max(prompts)))}


def chunk_sweep(runner: Any, prompts: list[int], chunks: list[int]) -> list[dict[str, Any]]:
    """Seconds to prefill each prompt fed as the engine feeds it with `--prefill-chunk` c: one
    runner call per c tokens (c at most the runner's own chunk). Second of two runs, as run_prompts."""
    rows = []
    rng = np.random.default_rng(0)
    for n in prompts:
        ids = rng.integers(0, runner.config.vocab_size, n).tolist()
        for c in chunks:
            if c > runner.prefill_chunk:
                raise ValueError(f"--sweep-chunks {c} exceeds --chunk {runner.prefill_chunk}")
            secs = prefill_seconds(runner, ids, c)
            rows.append({"tokens": n, "chunk": c, "seconds": secs, "tok_s": n / secs})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def render(data: dict[str, Any]) -> str:
    rate = data["matrix_rate_tflops"]
    lines = [f"Shape {data['shape']} (router {data['router']} where MoE), {data.get('format', 'bf16')} projections. "
             "Matrix ceiling in the same run: "
             f"**{rate:.0f} TFLOP/s** (our gemm_sm90, 8192 x 5120 x 17408). Prefill chunk {data['chunk']}."]
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
    if data.get("chunk_sweep"):
        lines += ["", "Prompts fed one engine chunk per runner call:", "",
                  "| prompt tokens | chunk | seconds | tok/s |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['tokens']} | {r['chunk']} | {r['seconds']:.3f} | {r['tok_s']:.0f} |" for r in data["chunk_sweep"]]
    vs = data.get("attention_vs_sdpa") or {}
    if "kernels" in vs:
        lines += ["", f"Prefill attention alone, {vs['tokens']} causal queries over as many keys (same Q/K/V; "
                  f"{vs['flops'] / 1e12:.2f} TFLOP = 4 * n^2 / 2 * Hq * D):", "",
                  "| kernel | ms | TFLOP/s | relative difference vs SDPA |", "|---|---:|---:|---:|"]
        lines += [f"| ours {name} (gate fused) | {r['us'] / 1e3:.2f} | {r['tflops']:.0f} | {r['rel_diff_vs_sdpa']:.1e} |"
                  for name, r in vs["kernels"].items()]
        lines += [f"| ours {name} over {r['split']}-key splits + combine | {r['us'] / 1e3:.2f} | {r['tflops']:.0f} | "
                  f"{r['rel_diff_vs_sdpa']:.1e} |" for name, r in vs.get("key_splits", {}).items()]
        lines.append(f"| torch SDPA flash (torch {vs['torch']}) | {vs['sdpa_flash_us'] / 1e3:.2f} | "
                     f"{vs['sdpa_tflops']:.0f} | |")
    elif vs:
        lines += ["", f"Attention vs SDPA not run: {vs.get('error')}"]
    fla = data.get("gdn_vs_fla") or {}
    if "fla_us" in fla:
        lines += ["", f"Gated DeltaNet prefill alone, one layer, one {fla['tokens']}-token sequence (same inputs):",
                  "", "| kernel | ms | relative difference vs fla |", "|---|---:|---:|"]
        for name in [key[:-3] for key in fla if key.endswith("_us") and key != "fla_us"]:
            lines.append(f"| ours ({name}) | {fla[f'{name}_us'] / 1e3:.3f} | {fla[f'{name}_rel_diff_vs_fla']:.1e} |")
        lines.append(f"| fla chunk_gated_delta_rule (fla {fla['fla']}, torch {fla['torch']}) | {fla['fla_us'] / 1e3:.3f} | |")
    elif fla:
        lines += ["", f"GDN vs fla not run: {fla.get('error')}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prompts", default="1024,8192")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--gdn", choices=(*GDN_MODES, "all"), default="chunked")
    ap.add_argument("--attn", choices=("split", "flash", "both"), default="flash")
    ap.add_argument("--attn-tokens", type=int, default=8192, help="queries for the SDPA comparison (0: skip)")
    ap.add_argument("--gdn-tokens", type=int, default=8192, help="tokens for the fla comparison (0: skip)")
    ap.add_argument("--synthetic-shape", default="qwen3.6-27b", help="model shape: a name of "
                    "runtime/model/shapes.py (qwen3.6-27b, qwen3.6-35b-a3b, qwen3-next-80b) or a JSON text config")
    ap.add_argument("--router", choices=("balanced", "skewed"), default="balanced",
                    help="synthetic MoE router: near-uniform routing, or a few hot experts")
    ap.add_argument("--sweep-chunks", default="", help="also prefill each prompt one engine chunk of each "
                    "size per runner call (comma list, each <= --chunk)")
    ap.add_argument("--format", choices=("bf16", "fp8", "nvfp4"), default="bf16",
                    help="projection weights: BF16, Qwen's FP8 recipe, or the NVFP4 recipe")
    args = ap.parse_args(argv)
    data = run([int(p) for p in args.prompts.split(",")], args.chunk, args.gdn, args.attn, args.attn_tokens,
               args.gdn_tokens, args.synthetic_shape, args.router,
               [int(c) for c in args.sweep_chunks.split(",") if c], args.format)
    data["command"] = "python -m bench.prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill.json").write_text(json.dumps(data, indent=1))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
