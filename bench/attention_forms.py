"""Decode attention alone, without a model: the split kernel's two forms (`split`: CUDA cores,
`attention.split`; `mma`: tensor cores, `attention_decode_mma`), each followed by the combine,
against torch SDPA (flash, GQA) on the same number of K/V bytes, as a share of the device copy
bandwidth measured in the same run.

    python -m bench.attention_forms --out DIR [--shape q24_kv4_d256] [--batches 1,8]
        [--contexts 1024,32768,131072,256000] [--splits 0] [--tokens 1] [--kv-dtype bf16,fp8,int8]

Each (batch, context, KV format): every sequence at position `context` (it sees context + 1 keys)
over its own consecutive pages of one K/V pool in that format (`runtime.model.kv_format`; each
form's variants for it), the split plan the runner would take for that context
(`storage.default_decode_splits` with the device's SM count and `DECODE_MIN_SPLIT`; `--splits N`
forces N), `--tokens T` query tokens per sequence (verification: the mma form serves them in one
CTA; the split form takes them as rows). K/V hold a constant (decode time does not depend on the
values). Bandwidth = K/V bytes read (quantised pages: codes and scales) / kernel time; a
quantised row also gives its mma form's speed over the bf16 row's of the same run. Writes
`attention_forms.json` and prints a Markdown table. `bench.decode` runs the same comparison
inside the model (`bench/decode_attention.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.timing import median_event_seconds
from runtime.model.kv_format import check_format, page_bytes

PAGE = 64


def _sdpa_us(batch: int, tokens: int, n: int, hq: int, hkv: int, d: int) -> float | None:
    """Median microseconds of torch's flash SDPA over [batch, Hkv, n, D] bf16 K/V (None: no torch)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001 - torch is optional for the bench
        return None
    q = torch.randn(batch, hq, tokens, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    times = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for _ in range(9):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    del q, k, v
    torch.cuda.empty_cache()
    return sorted(times)[4]


def measure(library: Any, device: Any, stream: Any, shape: str, batch: int, context: int, tokens: int,
            splits: int, kv: str = "bf16") -> dict[str, Any]:
    from cute_kernels import attention, attention_decode_mma
    from runtime.model.gpu.storage import DECODE_MIN_SPLIT, default_decode_splits

    cfg = next(v for v in attention.variants() if v.key == f"prep_{shape}").config
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    n = context + 1
    maxp = -(-(n + tokens) // PAGE)
    m = batch * tokens
    splits = splits or default_decode_splits(hkv, context + 64, device.sm_count)
    import numpy as np

    row_bytes = page_bytes(kv, hkv, d) // PAGE  # one token's K (or V) bytes over the KV heads
    pool = batch * maxp * PAGE * row_bytes
    bufs = []

    def alloc(nbytes: int) -> int:
        bufs.append(device.mem_alloc(max(nbytes, 4), "bench"))
        return bufs[-1]

    try:
        kp, vp = alloc(pool), alloc(pool)
        for pages in (kp, vp):
            if kv == "bf16":
                device.memset_d16(pages, 0x3C00, pool // 2, stream)  # 0.0078: finite and the same everywhere
            else:
                device.memset_d8(pages, 0x3C, pool, stream)  # codes 1.5 (fp8) / 60 (int8), scales 0.0115
        q, x = alloc(m * hq * d * 2), alloc(m * stride * 2)
        device.memset_d16(q, 0x3C00, m * hq * d, stream)
        device.memset_d16(x, 0x3C00, m * stride, stream)
        table = np.arange(batch * maxp, dtype=np.int32).reshape(batch, maxp)
        pos = np.array([context + t for t in range(tokens) for _ in range(batch)], np.int32)  # position-major
        qseq = np.array([b for _ in range(tokens) for b in range(batch)], np.int32)
        tbuf, pbuf, sbuf = alloc(table.nbytes), alloc(pos.nbytes), alloc(qseq.nbytes)
        for ptr, arr in ((tbuf, table), (pbuf, pos), (sbuf, qseq)):
            device.memcpy_htod(ptr, arr, stream)
        o_part, lse, out = alloc(m * hq * splits * d * 4), alloc(m * hq * splits * 4), alloc(m * hq * d * 2)
        stream.synchronize()
        rows = {"q": q, "k_pages": kp, "v_pages": vp, "table": tbuf, "qseq": sbuf, "pos": pbuf, "o_part": o_part,
                "lse": lse}
        sizes = {"M": m, "S": splits, "min_split": DECODE_MIN_SPLIT, "maxp": maxp, "R": batch,
                 "NP": batch * maxp}
        combine = library.kernel("attention", f"combine_{shape}").bind(
            {"o_part": o_part, "lse": lse, "pos": pbuf, "x": x, "out": out},
            {"M": m, "S": splits, "min_split": DECODE_MIN_SPLIT})
        tmax = min(t for t in attention_decode_mma.TOKENS if t >= tokens)
        suffix = "" if kv == "bf16" else f"_{kv}"
        forms = {"split": library.kernel("attention", f"split_{shape}{suffix}").bind(rows, sizes),
                 "mma": library.kernel("attention_decode_mma", f"mma_{shape}_t{tmax}{suffix}").bind(
                     rows, {**sizes, "T": tokens})}
        # The other forms of the quantised mma kernel, where built (`KVQ_FORMS`).
        stage_forms = sorted(entry.config["form"] for (fam, key), entry in library.manifest.kernels.items()
                             if fam == "attention_decode_mma" and entry.config["kv"] == kv
                             and entry.config["tmax"] == tmax and entry.config["form"]
                             and key.startswith(f"mma_{shape}_"))
        for form in stage_forms:
            forms[f"mma_{form}"] = library.kernel("attention_decode_mma", f"mma_{shape}_t{tmax}{suffix}_{form}").bind(
                rows, {**sizes, "T": tokens})
        kv_bytes = batch * (n + tokens - 1) * row_bytes * 2
        row: dict[str, Any] = {"shape": shape, "batch": batch, "context": context, "tokens": tokens, "kv_dtype": kv,
                               "splits": splits, "min_split": DECODE_MIN_SPLIT, "kv_bytes": kv_bytes,
                               "stage_forms": stage_forms}
        for form, split in forms.items():
            def work(st: Any, split: Any = split) -> None:
                split(st)
                combine(st)

            row[f"{form}_us"] = median_event_seconds(device, stream, work, repeats=9) * 1e6
            row[f"{form}_split_only_us"] = median_event_seconds(device, stream, split, repeats=9) * 1e6
    finally:
        stream.synchronize()
        for ptr in bufs:
            device.mem_free(ptr)
    sdpa = _sdpa_us(batch, tokens, n + tokens - 1, hq, hkv, d)
    if sdpa is not None:
        row["sdpa_us"] = sdpa
    return row


def _share(r: dict[str, Any], key: str, copy_tb_s: float) -> str:
    """Row r's K/V bytes over its time `key` as a share of the copy bandwidth ("-" if not timed)."""
    return f"{100 * r['kv_bytes'] / r[key] / 1e6 / copy_tb_s:.0f}%" if key in r else "-"


def render(rows: list[dict[str, Any]], copy_tb_s: float) -> str:
    """The table; "mma vs bf16 KV": the bf16 row's mma time (same shape, batch, context, T) over
    this row's, the speed-up of reading the quantised pages ("-" without that row)."""
    lines = [f"Copy bandwidth in the same run: **{copy_tb_s:.2f} TB/s** (read + write).", "",
             ("| shape | batch | context | T | KV | splits | split us (+combine) | mma us (+combine) | SDPA us "
              "| split of copy bw | mma of copy bw | SDPA of copy bw | mma split kernel alone us | mma vs bf16 KV |"),
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    bf16_mma = {(r["shape"], r["batch"], r["context"], r["tokens"]): r["mma_us"] for r in rows
                if r.get("kv_dtype", "bf16") == "bf16"}
    for r in rows:
        def share(key: str, r: dict[str, Any] = r) -> str:
            return _share(r, key, copy_tb_s)

        kv = r.get("kv_dtype", "bf16")
        base = bf16_mma.get((r["shape"], r["batch"], r["context"], r["tokens"]))
        speed = f"{base / r['mma_us']:.2f}x" if base and kv != "bf16" else "-"
        sdpa = f"{r['sdpa_us']:.1f}" if "sdpa_us" in r else "-"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['tokens']} | {kv} | {r['splits']} "
                     f"| {r['split_us']:.1f} | {r['mma_us']:.1f} | {sdpa} | {share('split_us')} | {share('mma_us')} "
                     f"| {share('sdpa_us')} | {r['mma_split_only_us']:.1f} | {speed} |")
    staged = [r for r in rows if r.get("stage_forms")]
    if staged:
        lines += ["", "The quantised mma kernel's other forms (`attention_decode_mma.KVQ_FORMS`; split + combine us, "
                  "share of the copy bandwidth; the table's mma column is the first form):", "",
                  "| shape | batch | context | T | KV | form | us | of copy bw |", "|---|---:|---:|---:|---|---|---:|---:|"]
        for r in staged:
            for form in r["stage_forms"]:
                lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['tokens']} | {r['kv_dtype']} "
                             f"| {form} | {r[f'mma_{form}_us']:.1f} | {_share(r, f'mma_{form}_us', copy_tb_s)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shape", default="q24_kv4_d256", help="attention shape key (cute_kernels/attention.py)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="1024,32768,131072,256000")
    ap.add_argument("--splits", type=int, default=0, help="splits per row (0: the runner's plan)")
    ap.add_argument("--tokens", type=int, default=1, help="query tokens per sequence (verification)")
    ap.add_argument("--kv-dtype", default="bf16", help="KV page formats to time, comma-separated (bf16,fp8,int8)")
    args = ap.parse_args(argv)
    formats = [check_format(f) for f in args.kv_dtype.split(",")]
    from bench.decode import copy_bandwidth
    from runtime.cuda.device import CudaDevice
    from runtime.cuda.kernels import KernelLibrary

    device = CudaDevice(0)
    library = KernelLibrary.open(device, required=[])
    stream = device.create_stream()
    bw = copy_bandwidth(device, stream) / 1e12
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for kv in formats:
                rows.append(measure(library, device, stream, args.shape, batch, context, args.tokens, args.splits,
                                    kv))
                print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"copy_bandwidth_tb_s": bw, "device": device.describe(), "rows": rows,
            "command": "python -m bench.attention_forms " + " ".join(argv if argv is not None else sys.argv[1:])}
    (args.out / "attention_forms.json").write_text(json.dumps(data, indent=1))
    print(render(rows, bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
