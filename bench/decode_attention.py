"""Decode attention alone (split-KV + combine, one layer) against torch SDPA on the same K/V, in
both split forms: `split` (CUDA cores, `attention.split`) and `mma` (tensor cores,
`attention_decode_mma`, where compiled), each followed by the same combine.

Called by `bench.decode` after it has timed a (batch, context) pair, with the items of that pair:
their metadata (positions, page tables) is on the device from the last decode step. Random K/V
for every row's context is written into the first attention layer's page pool, and a random q and
gate; our two launches are bound to the runner's own buffers and split plan (`decode_splits`,
`decode_min_split`), so this is exactly what one decode step launches per attention layer.
torch's SDPA runs on a contiguous copy `[B, Hkv, context, D]` of the same K/V with one query per
row, GQA native (`enable_gqa`) on the flash backend when torch offers it, else the K/V heads
repeated to Hq (then SDPA reads Hq/Hkv times more bytes; the row says which). Bandwidth is the
K/V bytes over the kernel time. The outputs are compared after dividing our sigmoid gate out.
With FP8 / INT8 KV (`runner.kv_dtype`) the random K/V are quantised on the GPU the way the prep
kernel does (per token-head amax scales) into the pages, and SDPA reads the dequantised values as
bf16; the bytes counted are the quantised pages' (codes and scales).
"""

from __future__ import annotations

from typing import Any

from bench.timing import median_event_seconds
from runtime.model.kv_format import QMAX, page_bytes


def _write_pages(torch: Any, runner: Any, pool: int, first_page: int, rows: Any) -> Any:
    """Write rows [n, Hkv, D] (bf16, torch) into `pool` from page `first_page` on, in the
    runner's KV format; returns the values the pages hold (bf16, torch)."""
    fmt, st, dev, s = runner.kv_dtype, runner.storage, runner.device, runner.stream
    n, hkv, d = rows.shape
    if fmt == "bf16":
        dev.memcpy_dtod(pool + first_page * st.page_bytes, rows.data_ptr(), rows.numel() * 2, s)
        s.synchronize()
        return rows
    pages = -(-n // 64)
    x = torch.zeros(pages * 64, hkv, d, device="cuda", dtype=torch.float32)
    x[:n] = rows.float()
    scale = x.abs().amax(dim=-1) / QMAX[fmt]
    y = x / scale.clamp_min(2.0 ** -149).unsqueeze(-1)
    if fmt == "fp8":
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
        values = codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
    else:
        codes = y.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        values = codes.view(torch.int8).float() * scale.unsqueeze(-1)
    raw = torch.cat([codes.reshape(pages, -1), scale.contiguous().view(torch.uint8).reshape(pages, -1)], dim=1)
    assert raw.shape[1] == page_bytes(fmt, hkv, d)
    raw = raw.contiguous()
    torch.cuda.synchronize()
    dev.memcpy_dtod(pool + first_page * st.page_bytes, raw.data_ptr(), raw.numel(), s)
    s.synchronize()
    return values[:n].to(torch.bfloat16)


def attention_vs_sdpa(runner: Any, batch: int, context: int, page_tables: list[list[int]]) -> dict[str, Any]:
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:  # noqa: BLE001 - torch is optional for the bench
        return {"batch": batch, "context": context, "error": f"torch unavailable: {exc}"}
    c, k, st, dev, s = runner.config, runner.kernels, runner.storage, runner.device, runner.stream
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    n = context + 1  # the decode row at position `context` sees context + 1 keys
    bucket = next(x for x in (1, 2, 4, 8) if x >= batch)
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(batch * 1_000_003 + context)
    q = torch.randn(bucket, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(bucket, k.attn_stride, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(bucket, hq * d, device="cuda", dtype=torch.bfloat16)
    kk = torch.randn(batch, n, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    vv = torch.randn(batch, n, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    torch.cuda.synchronize()
    row_bytes = st.page_bytes // 64  # one token's K (or V) bytes over the KV heads, in the format
    for b in range(batch):  # the items' pages are consecutive (`bench.decode.run`)
        kk[b] = _write_pages(torch, runner, st.k_pages[0], page_tables[b][0], kk[b])
        vv[b] = _write_pages(torch, runner, st.v_pages[0], page_tables[b][0], vv[b])
    rows = {"table": st.meta_ptr("table"), "qseq": st.meta_ptr("qseq"), "pos": st.meta_ptr("pos")}
    pad_pages = st.num_pages + 1
    combine = runner.library.kernel("attention", k.combine).bind(
        {"o_part": st.buf["o_part"], "lse": st.buf["lse"], "pos": st.meta_ptr("pos"), "x": x.data_ptr(),
         "out": out.data_ptr()}, {"M": bucket, "S": st.decode_splits, "min_split": st.decode_min_split})
    forms = {"split": ("attention", k.split, {})}
    if 1 in k.decode_mma:  # the mma form over the pool's format, where compiled
        forms["mma"] = ("attention_decode_mma", k.decode_mma[1], {"T": 1})
    timed: dict[str, Any] = {}
    for form, (family, key, tokens) in forms.items():
        split = runner.library.kernel(family, key).bind(
            {"q": q.data_ptr(), "k_pages": st.k_pages[0], "v_pages": st.v_pages[0], **rows,
             "o_part": st.buf["o_part"], "lse": st.buf["lse"]},
            {"M": bucket, "S": st.decode_splits, "min_split": st.decode_min_split, "maxp": st.maxp,
             "R": st.max_batch, "NP": pad_pages, **tokens})

        def ours(stream: Any, split: Any = split) -> None:
            split(stream)
            combine(stream)

        us = median_event_seconds(dev, s, ours, repeats=9) * 1e6
        ours(s)  # this form's output in `out`, for the comparison with SDPA
        s.synchronize()
        timed[form] = (us, out[:batch].view(batch, hq, d).float().clone())
    qt = q[:batch].unsqueeze(2)                              # [B, Hq, 1, D]
    kt = kk.permute(0, 2, 1, 3).contiguous()                # [B, Hkv, n, D]
    vt = vv.permute(0, 2, 1, 3).contiguous()
    mode = "flash, enable_gqa"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    except Exception:  # noqa: BLE001 - older torch: no GQA on the flash backend
        mode = "flash, K/V repeated to Hq"
        kt = kt.repeat_interleave(hq // hkv, dim=1)
        vt = vt.repeat_interleave(hq // hkv, dim=1)
    gqa = {"enable_gqa": True} if mode.endswith("enable_gqa") else {}
    times = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt, **gqa)
        for _ in range(9):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(qt, kt, vt, **gqa)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    sdpa_us = sorted(times)[4]
    torch.cuda.synchronize()
    gate = torch.sigmoid(x[:batch, :hq * 2 * d].view(batch, hq, 2 * d)[..., d:].float())
    want = ref[:, :, 0].float()
    kv_bytes = batch * n * row_bytes * 2
    row = {"batch": batch, "context": context, "kv_dtype": runner.kv_dtype, "splits": st.decode_splits, "min_split": st.decode_min_split,
           "sdpa_us": sdpa_us, "sdpa_mode": mode, "kv_bytes": kv_bytes, "sdpa_tb_s": kv_bytes / sdpa_us / 1e6,
           "torch": torch.__version__}
    for form, (us, got) in timed.items():
        row[f"{form}_us"] = us
        row[f"{form}_tb_s"] = kv_bytes / us / 1e6
        row[f"{form}_rel_diff_vs_sdpa"] = float((got / gate - want).norm() / want.norm())
    return row


def render(rows: list[dict[str, Any]], copy_bw_tb_s: float) -> str:
    """One line per (batch, context): each split form (+ combine) and SDPA, time, TB/s, share of
    the copy bandwidth, and the relative difference from SDPA's output."""
    lines = [("| batch | context | KV | splits x min | split us | mma us | SDPA us | split of copy bw | mma of copy bw "
              "| SDPA of copy bw | split rel diff | mma rel diff | SDPA mode |"),
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    def share(r: dict[str, Any], form: str) -> str:
        return f"{100 * r[f'{form}_tb_s'] / copy_bw_tb_s:.0f}%" if f"{form}_tb_s" in r else "-"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | | {r['error']} ||||||||||")
            continue
        lines.append(f"| {r['batch']} | {r['context']} | {r['kv_dtype']} | {r['splits']} x {r['min_split']} "
                     f"| {cell(r, 'split_us', '.1f')} "
                     f"| {cell(r, 'mma_us', '.1f')} | {r['sdpa_us']:.1f} | {share(r, 'split')} | {share(r, 'mma')} "
                     f"| {share(r, 'sdpa')} | {cell(r, 'split_rel_diff_vs_sdpa', '.1e')} "
                     f"| {cell(r, 'mma_rel_diff_vs_sdpa', '.1e')} | {r['sdpa_mode']} |")
    return "\n".join(lines)
