"""Decode speed of `CudaRunner` on a released model's shape with synthetic weights (BF16, or the
projections FP8 / NVFP4 with `--format`).

The shape is Qwen3.6-27B unless `--synthetic-shape` names another (qwen3.6-35b-a3b, qwen3-next-80b;
the 80B fits an H200 with `--format fp8` only: its experts are 155 GB in bf16).

    python -m bench.decode --out results/ [--batches 1,2,4,8] [--contexts 1024,32768] [--steps 20]
        [--max-tokens 300000] [--decode-splits S] [--min-split N] [--no-sdpa]
        [--synthetic-shape qwen3.6-35b-a3b|qwen3-next-80b [--router balanced|skewed]] [--format bf16|fp8|nvfp4]
        [--attention-form mma|split]
        [--kv-dtype bf16,fp8,int8,fp8:cvt] [--pdl on|off|off,on] [--moe-form route_up_f8_r1,up_wide_f8_r1]
        [--gate-up-silu on|off]

For each (batch, context) it times decode steps replayed from the CUDA graph of that batch bucket:
GPU time per step (CUDA events around back-to-back replays) and wall time per step until the
sampled ids are on the host (metadata upload, replay, then either the logits download and the
host sampler, or the GPU sampling kernels and the ids download; both reported, tok/s = batch /
the better wall time). Contexts are set by position
(the KV pages and states hold synthetic contents; decode cost does not depend on their values).
The roofline is bytes that must move per step (every weight read once, embedding rows excepted;
for a MoE model only the experts the step's routing touched, counted from the last layer's
routing after the timed steps (at batch 1 every layer touches k experts), plus the shared expert;
KV read for the context; the GDN state read and written) over the device-to-device copy bandwidth
measured in the same run. A per-kernel breakdown of one step (events between eager launches) and
the host overhead per step are reported too, and (when torch is importable) decode attention
alone against torch SDPA at each pair (`bench/decode_attention.py`). `--max-tokens` skips the
pairs whose batch x context exceeds it and sizes the KV pool for the largest pair kept (batch 8 at
250K does not fit next to the 27B's weights). Writes `decode.json` and prints Markdown tables.
`--kv-dtype` takes a list of KV formats: each gets its own runner and run (`decode_<fmt>.json`
when more than one) and a last table compares their GPU time per step at each pair
(`kv_dtypes.json`); an entry `fp8:cvt` runs the decode attention's mma form `cvt` over that format
(`attention_decode_mma.KVQ_FORMS`). `--pdl off,on` times every pair without and then with
programmatic dependent launch on the same runner (`decode_pdl_off.json`, `decode_pdl_on.json`) and compares the two;
`--moe-form` likewise times each MoE decode form named (`decode_moe_<form>.json`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.timing import median_event_seconds, plan_breakdown_us
from runtime.model.kv_format import FORMATS as KV_FORMATS
from runtime.model.kv_format import token_head_bytes

from runtime.model.shapes import QWEN36_27B  # noqa: F401 (the GPU tests take the shape from here)



def copy_bandwidth(device: Any, stream: Any, nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second of a large device-to-device copy (median of 5)."""
    src, dst = device.mem_alloc(nbytes), device.mem_alloc(nbytes)
    try:
        return 2 * nbytes / median_event_seconds(
            device, stream, lambda st: device.memcpy_dtod(dst, src, nbytes, st))
    finally:
        device.mem_free(src)
        device.mem_free(dst)


def make_runner(max_batch: int, max_context: int, prefill_chunk: int = 512, seed: int = 0,
                decode_splits: int | None = None, min_split: int | None = None, weight_format: str = "bf16",
                spare_slots: int = 0, mtp: bool = False, shape: str = "qwen3.6-27b", router: str = "balanced",
                pages: int | None = None, kv_dtype: str = "bf16") -> Any:
    """weight_format "fp8": the projections as in Qwen's FP8 release (`weights.fp8_recipe_format`),
    "nvfp4": as `tools.convert --recipe nvfp4` writes them (`weights.nvfp4_recipe_format`);
    spare_slots: state slots past the lanes (verification snapshots); mtp: a (random) MTP head;
    shape: a name of `runtime.model.shapes.SHAPES` or a JSON text config; router: the synthetic
    MoE router (`weights.fill_synthetic`); decode_splits, min_split: the decode attention plan
    (runner defaults if None); pages: the KV pool (default: every batch row at max_context); kv_dtype: the
    KV pages' format (`runtime.model.kv_format`)."""
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import fp8_recipe_format, nvfp4_recipe_format
    from runtime.model.shapes import shape_config

    config = ModelConfig.from_dict(shape_config(shape))
    pages = pages or max_batch * (-(-max_context // 64) + 1)
    return CudaRunner.synthetic(config, seed, num_pages=pages, num_slots=max_batch + spare_slots, max_batch=max_batch,
                                max_context=max_context + 64, prefill_chunk=prefill_chunk,
                                weight_formats={"fp8": fp8_recipe_format,
                                                "nvfp4": nvfp4_recipe_format}.get(weight_format),
                                mtp=mtp, synthetic_router=router, kv_dtype=kv_dtype,
                                **({"decode_splits": decode_splits} if decode_splits else {}),
                                **({"decode_min_split": min_split} if min_split else {}))


def experts_touched(runner: Any, batch: int) -> int:
    """Distinct routed experts among the batch rows of the last MoE layer of the last step (0 for a
    dense model): the routing is on the device (`moe_ids`, k routed slots then the shared one)."""
    import numpy as np

    c = runner.config
    if not runner.kernels.moe_route:
        return 0
    p = c.num_experts_per_tok + 1
    ids = np.empty(batch * p, np.int32)
    runner.stream.synchronize()
    runner.device.memcpy_dtoh(ids, runner.storage.buf["moe_ids"], runner.stream)
    runner.stream.synchronize()
    return len(np.unique(ids.reshape(batch, p)[:, :-1]))


def step_bytes(runner: Any, batch: int, context: int, touched: int = 0) -> int:
    """touched: routed experts one MoE layer reads (`experts_touched`); each MoE layer is counted
    as reading them and the shared expert instead of its whole expert stack."""
    c = runner.config
    weights = runner.layout.total - runner.layout.globals["embed"].nbytes + batch * c.hidden_size * 2
    for layer in runner.layout.layers:
        if "experts_gate_up" in layer:
            stacks = layer["experts_gate_up"].nbytes + layer["experts_down"].nbytes
            weights += stacks * (touched + 1) // (c.num_experts + 1) - stacks
    kv = batch * context * len(c.attention_layers) * c.num_key_value_heads * token_head_bytes(runner.kv_dtype,
                                                                                              c.head_dim)
    state = batch * len(c.linear_layers) * 2 * runner.storage.state_slot_bytes
    return weights + kv + state


def kernel_breakdown(runner: Any, bucket: int) -> dict[str, float]:
    """Microseconds per kernel key over one eager decode step (events between launches)."""
    return plan_breakdown_us(runner.device, runner.stream, runner.steps.decode_plan(bucket), rounds=3)


SAMPLING_MODES = ("host", "device", "device+ahead")
SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "presence_penalty": 1.5}


def timed_steps(runner: Any, items: list, context: int, steps: int, mode: str) -> float:
    """Wall seconds per decode step that ends with sampled ids on the host: `host` downloads
    the logits and runs the host sampler per row, `device` samples on the GPU
    (`decode_sampled`), `device+ahead` also lets the runner queue the next step before it
    returns (look-ahead; every step here continues the same sequences, so each is used).
    Sampling settings: `SAMPLING` (a Qwen thinking preset with a presence penalty), each row its
    own seed."""
    from runtime.engine.api import SamplingParams
    from runtime.engine.sampler import SamplerState, sample_token
    from runtime.model.runner import DecodeItem

    states = [SamplerState(SamplingParams(seed=i, **SAMPLING)) for i in range(len(items))]
    wall0 = time.perf_counter()
    for i in range(steps):
        step = [DecodeItem(it.slot, it.token_id, context + i, it.page_table) for it in items]
        if mode.startswith("device"):
            ids = runner.decode_sampled(step, lambda: [st.row_sampling(runner.vocab_size, None) for st in states],
                                        lookahead=mode == "device+ahead" and i + 1 < steps)
            tokens = [st.took(int(t)) for st, t in zip(states, ids)]
            items = [DecodeItem(it.slot, t, it.pos, it.page_table) for it, t in zip(items, tokens)]
        else:
            logits = runner.decode(step)
            tokens = [sample_token(row, st) for row, st in zip(logits, states)]
        for st, t in zip(states, tokens):
            st.observe(t)
    return (time.perf_counter() - wall0) / steps


def run(batches: list[int], contexts: list[int], steps: int, decode_splits: int | None = None,
        weight_format: str = "bf16", drafts: tuple[int, ...] = (), mtp_drafts: tuple[int, ...] = (),
        shape: str = "qwen3.6-27b", router: str = "balanced", min_split: int | None = None,
        max_tokens: int | None = None, sdpa: bool = True, gdn_min_ctas: int | None = None,
        draft_vocabs: tuple[int, ...] = (), attention_form: str | None = None,
        kv_dtype: str = "bf16", pdl_modes: tuple[str, ...] = ("default",),
        kv_form: str | None = None, moe_forms: tuple[str | None, ...] = (None,)) -> list[dict[str, Any]]:
    """One result per PDL mode ("on", "off", or "default": runtime/model/gpu/kernels.py's PDL) and
    MoE decode form (a bench.moe_forms name such as "up_wide_f8_r1" at every row count, or "default"
    / None: the runner's MOE_DECODE_FORM and MOE_UP_WIDE_ROWS), all
    timed on one runner: its plans and graphs are bound again for each. kv_form: the decode
    attention's mma form over the KV pages (`KernelChoice.use_decode_mma_form`; None: the runner's)."""
    pairs = [(c, b) for c in contexts for b in batches if max_tokens is None or b * c <= max_tokens]
    if not pairs:
        raise ValueError(f"no (batch, context) pair within --max-tokens {max_tokens}")
    most = max((*drafts, *mtp_drafts), default=-1)
    spare = max(batches) * (most + 1) if most >= 0 else 0
    # Chained MTP drafts write up to 2k - 1 positions past the context (see below).
    tail = steps + 2 + 2 * max(mtp_drafts, default=0)
    pages = max(b * (-(-(c + tail) // 64) + 1) for c, b in pairs)
    runner = make_runner(max(b for _, b in pairs), max(c for c, _ in pairs), decode_splits=decode_splits,
                         min_split=min_split, weight_format=weight_format, spare_slots=spare, mtp=bool(mtp_drafts),
                         shape=shape, router=router, pages=pages, kv_dtype=kv_dtype)
    try:
        if kv_form is not None:  # before any step is bound
            runner.kernels.use_decode_mma_form(kv_form)
        runs = []
        for mode in pdl_modes:
            for moe_form in moe_forms:
                if mode != "default" or moe_form is not None:
                    runner.steps.destroy_graphs()  # every plan and graph bound again with these kernels
                if mode != "default":
                    runner.kernels.pdl = mode == "on"
                if moe_form == "default":
                    from runtime.model.gpu.kernels import MOE_DECODE_FORM, MOE_UP_WIDE_ROWS

                    runner.kernels.use_moe_decode_form(MOE_DECODE_FORM, MOE_UP_WIDE_ROWS)
                elif moe_form is not None:
                    runner.kernels.use_moe_decode_form(moe_form_tuple(moe_form))
                runs.append({**_timed(runner, pairs, contexts, steps, drafts, mtp_drafts, shape, router, sdpa,
                                      gdn_min_ctas, draft_vocabs, tail, attention_form), "moe_form": moe_form})
        return runs
    finally:
        runner.close()  # the next KV format's runner needs the memory


def moe_form_tuple(name: str) -> tuple[str, int, str]:
    """A MoE decode form's bench.moe_forms name ("up_wide_f16_r2") as MOE_DECODE_FORM's tuple
    ("up_wide", 16, "r2")."""
    gate_up, features, down = (name.rsplit("_", 2) + ["", ""])[:3]
    if not features.startswith("f") or not features[1:].isdigit() or not gate_up or not down:
        raise ValueError(f"MoE decode form {name!r}: expected GATEUP_fF_DOWN, as in route_up_f8_r1")
    return gate_up, int(features[1:]), down


def _timed(runner: Any, pairs: list, contexts: list[int], steps: int, drafts: tuple[int, ...],
           mtp_drafts: tuple[int, ...], shape: str, router: str, sdpa: bool, gdn_min_ctas: int | None,
           draft_vocabs: tuple[int, ...], tail: int, attention_form: str | None) -> dict[str, Any]:
    from bench import decode_attention, mtp_round, verify_step
    from runtime.model.runner import DecodeItem

    if gdn_min_ctas is not None:  # before any step is bound: every plan takes the GDN kernels it picks
        runner.kernels.gdn_min_ctas = gdn_min_ctas
    if attention_form is not None:  # likewise the decode attention split kernel
        runner.kernels.use_decode_attention(attention_form)
    dev, s = runner.device, runner.stream
    bw = copy_bandwidth(dev, s)
    results = []
    attention = []
    breakdown = {}
    for context, batch in pairs:
        maxp = -(-(context + steps + 2) // 64)
        items = [DecodeItem(slot=b, token_id=1000 + b, pos=context, page_table=list(range(b * maxp, (b + 1) * maxp)))
                 for b in range(batch)]
        runner.decode(items)  # capture
        runner.decode(items)
        wall = {mode: timed_steps(runner, items, context, steps, mode) for mode in SAMPLING_MODES
                if mode == "host" or runner.samples_on_device}
        # GPU-only time of the graph (no host work in between): replay back to back.
        bucket = next(x for x in (1, 2, 4, 8) if x >= batch)
        graph = runner.steps.graphs[bucket]
        start, end = dev.create_event(), dev.create_event()
        start.record(s)
        for _ in range(steps):
            graph.replay(s)
        end.record(s)
        end.synchronize()
        graph_ms = end.elapsed_ms(start) / steps
        touched = experts_touched(runner, batch)
        nbytes = step_bytes(runner, batch, context, touched)
        floor_ms = nbytes / bw * 1e3
        best = min(wall.values())
        row = {"batch": batch, "context": context, "experts_touched": touched, "graph_ms": graph_ms,
               "wall_ms": best * 1e3,
               "tok_s": batch / best, "host_ms": best * 1e3 - graph_ms, "bytes": nbytes,
               "floor_ms": floor_ms, "roofline_fraction": floor_ms / graph_ms,
               "roofline_fraction_wall": floor_ms / (best * 1e3),
               "wall_ms_by_sampling": {mode: w * 1e3 for mode, w in wall.items()}}
        results.append(row)
        print(json.dumps(row), flush=True)
        if batch == 1:
            breakdown[str(context)] = kernel_breakdown(runner, 1)
        if sdpa:
            runner.decode(items)  # the device metadata back at `context` (the timed steps moved on)
            attention.append(decode_attention.attention_vs_sdpa(runner, batch, context,
                                                                [it.page_table for it in items]))
            print(json.dumps(attention[-1]), flush=True)
    kept = sorted({b for _, b in pairs})
    top = max(c for c, _ in pairs)
    verification = verify_step.run(runner, kept, list(drafts), min(contexts),
                                   -(-(top + steps + 2) // 64), steps) if drafts else []
    # Chained drafts write up to 2k - 1 positions past the context: the pages cover steps + 2 + 2k.
    rounds = mtp_round.run(runner, kept, list(mtp_drafts), min(contexts), -(-(top + tail) // 64), steps,
                           [v or runner.vocab_size for v in draft_vocabs]) if mtp_drafts else []
    return {"copy_bandwidth_tb_s": bw / 1e12, "device": dev.describe(), "shape": shape, "router": router,
            "kv_dtype": runner.kv_dtype, "kv_form": runner.kernels.decode_mma_form,
            "gdn_min_ctas": runner.kernels.gdn_min_ctas, "pdl": runner.kernels.pdl,
            "verification": verification, "mtp_rounds": rounds,
            "decode_splits": runner.storage.decode_splits, "decode_min_split": runner.storage.decode_min_split,
            "attention_form": runner.kernels.decode_attention_form, "results": results, "attention_vs_sdpa": attention,
            "breakdown_us": breakdown}


def render(data: dict[str, Any]) -> str:
    lines = [(f"Copy bandwidth in the same run: **{data['copy_bandwidth_tb_s']:.2f} TB/s** (read + write); decode "
              f"attention form of the steps: {data.get('attention_form', 'split')}."), "",
             "| batch | context | GPU ms/step (graph) | wall ms/step, host sampling | wall ms/step, device sampling "
             "| wall ms/step, device + look-ahead | tok/s | host ms/step | floor ms | of roofline (GPU) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["results"]:
        by = r["wall_ms_by_sampling"]
        device, ahead = (f"{by[m]:.2f}" if m in by else "n/a" for m in ("device", "device+ahead"))
        lines.append(f"| {r['batch']} | {r['context']} | {r['graph_ms']:.2f} | {by['host']:.2f} | {device} | {ahead} | "
                     f"{r['tok_s']:.1f} | {r['host_ms']:.2f} | {r['floor_ms']:.2f} | {100 * r['roofline_fraction']:.0f}% |")
    if data.get("attention_vs_sdpa"):
        from bench import decode_attention

        lines += ["", "Decode attention alone (one layer: split + combine) against torch SDPA on the same K/V:", "",
                  decode_attention.render(data["attention_vs_sdpa"], data["copy_bandwidth_tb_s"])]
    for ctx, kernels in data["breakdown_us"].items():
        total = sum(kernels.values())
        lines += ["", f"One eager decode step at batch 1, context {ctx}: {total:.0f} us of kernels", "",
                  "| kernel | us per step | share |", "|---|---:|---:|"]
        for name, us in list(kernels.items())[:14]:
            lines.append(f"| {name} | {us:.1f} | {100 * us / total:.1f}% |")
    if data.get("verification"):
        from bench import verify_step

        lines += ["", "Verification rows against a decode step (`runner.step`, logits on the host):", "",
                  verify_step.render(data["verification"])]
    if data.get("mtp_rounds"):
        from bench import mtp_round

        lines += ["", "Speculative rounds of k MTP drafts + verification + commit against a decode step:", "",
                  mtp_round.render(data["mtp_rounds"])]
    return "\n".join(lines)


def _kv_label(run: dict[str, Any]) -> str:
    """A run's KV format, with its mma form where not the first one (`fp8:cvt`)."""
    return run["kv_dtype"] + (f":{run['kv_form']}" if run.get("kv_form") else "")


def _run_label(run: dict[str, Any]) -> str:
    return f"PDL {'on' if run['pdl'] else 'off'}" + (f", MoE {run['moe_form']}" if run.get("moe_form") else "")


def render_kv_dtypes(runs: list[dict[str, Any]], label: Any = _kv_label) -> str:
    """GPU ms per decode step of each run (by default each KV format; `label` names a run) at each
    (batch, context), and the speed-up of each over the first run (bf16 when listed first)."""
    base = label(runs[0])
    head = " | ".join(f"{label(r)} ms" + ("" if r is runs[0] else f" (x vs {base})") for r in runs)
    lines = [f"| batch | context | {head} |", "|---:|---:|" + "---:|" * len(runs)]
    for i, row in enumerate(runs[0]["results"]):
        cells = []
        for r in runs:
            ms = r["results"][i]["graph_ms"]
            # Three decimals: a target such as 1.1x must not pass by rounding (1.096x).
            cells.append(f"{ms:.2f}" if r is runs[0] else f"{ms:.2f} ({row['graph_ms'] / ms:.3f}x)")
        lines.append(f"| {row['batch']} | {row['context']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--synthetic-shape", default="qwen3.6-27b",
                    help="model shape: a name of runtime/model/shapes.py (qwen3.6-27b, qwen3.6-35b-a3b, "
                    "qwen3-next-80b) or a JSON "
                    "text config")
    ap.add_argument("--router", choices=("balanced", "skewed"), default="balanced",
                    help="synthetic MoE router: near-uniform routing, or a few hot experts")
    ap.add_argument("--format", choices=("bf16", "fp8", "nvfp4"), default="bf16",
                    help="projection weights: bf16, fp8 with 128x128 block scales (Qwen's FP8 release), or nvfp4 "
                    "(e2m1 codes, e4m3 scale per 16, fp32 global; lm_head and in_proj_a/b bf16)")
    ap.add_argument("--kv-dtype", default="bf16", help="KV formats to run, comma-separated (bf16,fp8,int8), each "
                    "optionally with the decode attention's mma form over it (fp8:cvt): one runner and run each, "
                    "then a table of the GPU time per step side by side")
    ap.add_argument("--decode-splits", type=int, help="decode attention splits per row (runner default if omitted)")
    ap.add_argument("--min-split", type=int, help="fewest keys per decode attention split (runner default if omitted)")
    ap.add_argument("--max-tokens", type=int, help="skip (batch, context) pairs with batch x context above this; the "
                    "KV pool is sized for the largest pair kept")
    ap.add_argument("--attention-form", choices=("mma", "split"),
                    help="decode attention split kernel of the timed steps: tensor cores (mma) or CUDA cores "
                         "(split); runtime/model/gpu/kernels.py's DECODE_ATTENTION_FORM if omitted")
    ap.add_argument("--no-sdpa", action="store_true", help="skip decode attention alone against torch SDPA")
    ap.add_argument("--gdn-min-ctas", type=int, help="CTAs the recurrent GDN kernels' column blocks aim for "
                    "(runtime/model/gpu/kernels.py; 0: one block per head, the kernels before column blocks)")
    ap.add_argument("--moe-form", default="", help="MoE decode forms to time on one runner, comma-separated "
                    "(bench.moe_forms names, or `default`: the runner's MOE_DECODE_FORM and MOE_UP_WIDE_ROWS)")
    ap.add_argument("--gate-up-silu", choices=("on", "off"), default="on",
                    help="off: decode steps run the dense MLP's gate/up GEMV and silu_mul as two launches "
                         "(runtime/model/gpu/kernels.py GATE_UP_SILU), to time the fused epilogue against them")
    ap.add_argument("--pdl", default="default", help="programmatic dependent launch in the decode and "
                    "verification graphs: on, off, or both (off,on: timed one after the other on one runner, "
                    "then side by side); runtime/model/gpu/kernels.py's PDL if omitted")
    ap.add_argument("--verify", default="", help="draft lengths k (comma-separated): also time "
                    "verification rows of 1 + k tokens against a decode step (bench/verify_step.py)")
    ap.add_argument("--mtp-rounds", default="", help="draft lengths k (comma-separated): also time rounds of k "
                    "MTP drafts + verification + commit against a decode step (bench/mtp_round.py)")
    ap.add_argument("--mtp-draft-vocab", default="", help="with --mtp-rounds: draft vocabularies to time "
                    "(comma-separated, 0 = the whole vocabulary), e.g. 0,32768")
    ap.add_argument("--spec", choices=("mtp", "ngram"), help="measure speculative decoding instead: "
                    "acceptance on the CPU tiny model (bench/speculative.py); --mtp-rounds times a round on "
                    "the GPU")
    ap.add_argument("--draft-tokens", type=int, default=3, help="drafts per round with --spec")
    ap.add_argument("--model", type=Path, help="with --spec: a .infernix model (default: a tiny one)")
    ap.add_argument("--requests", type=int, default=4, help="with --spec: requests to run")
    ap.add_argument("--max-new", type=int, default=64, help="with --spec: tokens per request")
    args = ap.parse_args(argv)
    if args.spec is not None:
        from bench import speculative

        data = speculative.run(args.spec, args.draft_tokens, args.model, args.requests, args.max_new)
        data["command"] = "python -m bench.decode " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"decode_spec_{args.spec}.json").write_text(json.dumps(data, indent=1))
        print(speculative.render(data))
        return 0
    formats = args.kv_dtype.split(",")
    bad = [f for f in formats if f.partition(":")[0] not in KV_FORMATS]
    if bad or not formats:
        ap.error(f"--kv-dtype: {','.join(bad) or 'nothing'} is not a list of {', '.join(KV_FORMATS)}")
    pdl_modes = tuple(args.pdl.split(","))
    if not pdl_modes or any(m not in ("on", "off", "default") for m in pdl_modes) or len(set(pdl_modes)) < len(pdl_modes):
        ap.error(f"--pdl {args.pdl!r}: on, off or off,on")
    moe_forms = tuple(args.moe_form.split(",")) if args.moe_form else (None,)
    try:
        for form in moe_forms:
            if form not in (None, "default"):
                moe_form_tuple(form)
    except ValueError as e:
        ap.error(f"--moe-form: {e}")
    command = "python -m bench.decode " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    from runtime.model.gpu import kernels as kernel_choice

    kernel_choice.GATE_UP_SILU = args.gate_up_silu == "on"  # read when the runners bind their steps
    runs = []
    for entry in formats:
        fmt, _, form = entry.partition(":")
        by_pdl = run([int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")],
                     args.steps, args.decode_splits, args.format, tuple(int(k) for k in args.verify.split(",") if k),
                     tuple(int(k) for k in args.mtp_rounds.split(",") if k), args.synthetic_shape, args.router,
                     args.min_split, args.max_tokens, not args.no_sdpa, args.gdn_min_ctas,
                     tuple(int(v) for v in args.mtp_draft_vocab.split(",") if v), args.attention_form, kv_dtype=fmt,
                     pdl_modes=pdl_modes, kv_form=form or None, moe_forms=moe_forms)
        for data in by_pdl:
            data["command"] = command
            pdl = "" if len(pdl_modes) == 1 else f"_pdl_{'on' if data['pdl'] else 'off'}"
            moe = "" if len(moe_forms) == 1 else f"_moe_{data['moe_form']}"
            name = ("decode" if len(formats) == 1 else f"decode_{entry.replace(':', '_')}") + pdl + moe + ".json"
            (args.out / name).write_text(json.dumps(data, indent=1))
            print(f"\n## KV {entry}, {_run_label(data)}\n\n" + render(data), flush=True)
        if len(by_pdl) > 1:
            print(f"\n## GPU ms per decode step (KV {entry}) by PDL mode and MoE form\n\n"
                  + render_kv_dtypes(by_pdl, _run_label), flush=True)
        runs.append(by_pdl[0])
    if len(runs) > 1:
        table = render_kv_dtypes(runs)
        (args.out / "kv_dtypes.json").write_text(json.dumps(
            {"command": command, "formats": formats,
             "graph_ms": {_kv_label(r): [(x["batch"], x["context"], x["graph_ms"]) for x in r["results"]]
                          for r in runs}}, indent=1))
        print("\n## GPU ms per decode step by KV format\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
