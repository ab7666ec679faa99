"""Kernel microbenchmarks: each kernel against its peer and against the ceiling, in one run.

    python -m bench.kernels --out results/            # on a GPU box with built kernels and torch
    python -m bench.kernels --render results/kernels.json --update-doc docs/performance.md

Ceilings are measured in the same run: device-to-device copy bandwidth (bytes read + written,
`cuMemcpyDtoDAsync` on 2 GiB) and the bf16 matrix rate (`torch.matmul` 8192^3 on random data).
Peers run on the same GPU in the same process: cuBLAS through `torch.matmul` for the GEMM and
GEMV, torch's own ops for the rest. Every timing is a CUDA graph of several launches replayed
several times and timed with CUDA events (so host launch cost is excluded for both sides); GEMM
and GEMV weights rotate over enough copies that L2 cannot serve them; ours and the peer are
interleaved round by round (clocks drop under sustained matrix load) and medians are reported.
torch is used here only, never by the runtime.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .moe_grouped import bench_moe_prefill
from .kernels_quant import bench_gemm_fp8, bench_gemv_q

DOC_BEGIN = "<!-- kernels:begin (written by bench/kernels.py) -->"
DOC_END = "<!-- kernels:end -->"
L2_BYTES = 60 << 20


class Bench:
    def __init__(self, rounds: int):
        import torch

        from runtime.cuda.device import CudaDevice, Stream
        from runtime.cuda.kernels import KernelLibrary

        self.torch = torch
        self.device = CudaDevice(0)
        torch.cuda.init()
        self.lib = KernelLibrary.open(self.device, required=[])
        self.stream = self.device.create_stream()
        self.torch_stream = torch.cuda.ExternalStream(int(self.stream.handle))
        self.Stream = Stream
        self.rounds = rounds
        self.results: list[dict[str, Any]] = []
        self.ceilings: dict[str, float] = {}

    # ------------------------------------------------------------------ timing
    def _time_graph(self, replay: Callable[[], None], launches: int, reps: int = 5) -> float:
        """Microseconds per launch of a graph holding `launches` launches."""
        dev, s = self.device, self.stream
        replay()
        s.synchronize()
        start, end = dev.create_event(), dev.create_event()
        start.record(s)
        for _ in range(reps):
            replay()
        end.record(s)
        end.synchronize()
        return end.elapsed_ms(start) * 1e3 / (reps * launches)

    def ours(self, bound: list[Any]) -> Callable[[], float]:
        from runtime.cuda.device import capture_graph

        s = self.stream
        graph = capture_graph(self.device, s, lambda: [b(s) for b in bound])
        return lambda: self._time_graph(lambda: graph.replay(s), len(bound))

    def peer(self, fns: list[Callable[[], Any]]) -> Callable[[], float]:
        torch = self.torch
        with torch.cuda.stream(self.torch_stream):
            for f in fns:  # warm up outside capture (cuBLAS workspace, autotuning)
                f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        torch.cuda.synchronize()

        def replay() -> None:
            with torch.cuda.stream(self.torch_stream):
                graph.replay()

        return lambda: self._time_graph(replay, len(fns))

    def compare(self, ours: Callable[[], float], peer: Callable[[], float] | None) -> tuple[float, float | None]:
        a, b = [], []
        for _ in range(self.rounds):
            a.append(ours())
            if peer is not None:
                b.append(peer())
        return statistics.median(a), (statistics.median(b) if b else None)

    # ------------------------------------------------------------------ ceilings
    def measure_ceilings(self) -> None:
        torch = self.torch
        n = 2 << 30
        src = self.device.mem_alloc(n, "copy ceiling")
        dst = self.device.mem_alloc(n, "copy ceiling")
        rates = []
        for _ in range(self.rounds):
            start, end = self.device.create_event(), self.device.create_event()
            start.record(self.stream)
            for _ in range(5):
                self.device.memcpy_dtod(dst, src, n, self.stream)
            end.record(self.stream)
            end.synchronize()
            rates.append(2 * n * 5 / (end.elapsed_ms(start) * 1e-3) / 1e12)
        self.device.mem_free(src)
        self.device.mem_free(dst)
        self.ceilings["copy_TBps"] = statistics.median(rates)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        t = self.peer([lambda: a @ b] * 5)
        self.ceilings["bf16_TFLOPs"] = 2 * 8192**3 / (statistics.median(t() for _ in range(self.rounds)) * 1e-6) / 1e12
        del a, b

    # ------------------------------------------------------------------ record
    def record(self, family: str, key: str, case: str, us: float, peer_us: float | None, peer: str,
               nbytes: float = 0.0, flops: float = 0.0) -> None:
        row: dict[str, Any] = {"family": family, "key": key, "case": case, "us": round(us, 2), "peer": peer,
                               "peer_us": None if peer_us is None else round(peer_us, 2)}
        if nbytes:
            row["TBps"] = round(nbytes / (us * 1e-6) / 1e12, 3)
            row["of_copy_bw"] = round(row["TBps"] / self.ceilings["copy_TBps"], 3)
        if flops:
            row["TFLOPs"] = round(flops / (us * 1e-6) / 1e12, 1)
            row["of_matrix_rate"] = round(row["TFLOPs"] / self.ceilings["bf16_TFLOPs"], 3)
        if peer_us:
            row["speedup_vs_peer"] = round(peer_us / us, 3)
        self.results.append(row)
        print(json.dumps(row), flush=True)


def _bf16(torch: Any, *shape: int, scale: float = 1.0) -> Any:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def bench_norms(b: Bench, m: int) -> None:
    torch = b.torch
    F = torch.nn.functional
    for key, h in (("zc_h5120", 5120), ("add_zc_h5120", 5120), ("gated_h128", 128)):
        rows = m if h > 128 else m * 48  # the GDN norm runs per value head (48 on the 27B)
        k = b.lib.kernel("rmsnorm", key)
        x, w, out = _bf16(torch, rows, h), _bf16(torch, h, scale=0.1), torch.empty(rows, h, device="cuda", dtype=torch.bfloat16)
        w1 = (1 + w.float()).to(torch.bfloat16)
        bufs = {"x": x.data_ptr(), "w": w.data_ptr(), "out": out.data_ptr()}
        if key.startswith("add"):
            res = _bf16(torch, rows, h)
            bufs["residual"] = res.data_ptr()
            nbytes = 4 * rows * h * 2
            peer = lambda: F.rms_norm(x + res, (h,), w1, 1e-6)  # noqa: E731
        elif key.startswith("gated"):
            z = _bf16(torch, rows, h)
            bufs["z"] = z.data_ptr()
            nbytes = 3 * rows * h * 2
            peer = lambda: F.rms_norm(x, (h,), w, 1e-6) * F.silu(z)  # noqa: E731
        else:
            nbytes = 2 * rows * h * 2
            peer = lambda: F.rms_norm(x, (h,), w1, 1e-6)  # noqa: E731
        bound = [k.bind(bufs, {"M": rows})] * 10
        us, peer_us = b.compare(b.ours(bound), b.peer([peer] * 10))
        b.record("rmsnorm", key, f"M={m}" + (" x 48 heads" if h == 128 else ""), us, peer_us, "torch", nbytes)


def bench_elementwise(b: Bench, m: int) -> None:
    torch = b.torch
    F = torch.nn.functional
    # silu_mul
    k = b.lib.kernel("silu_mul", "i17408")
    x, out = _bf16(torch, m, 2 * 17408), torch.empty(m, 17408, device="cuda", dtype=torch.bfloat16)
    bound = [k.bind({"x": x.data_ptr(), "out": out.data_ptr()}, {"M": m})] * 10
    us, peer_us = b.compare(b.ours(bound), b.peer([lambda: F.silu(x[:, :17408]) * x[:, 17408:]] * 10))
    b.record("silu_mul", "i17408", f"M={m}", us, peer_us, "torch", 3 * m * 17408 * 2)
    # embedding
    k = b.lib.kernel("embedding", "v248320_h5120")
    table = _bf16(torch, 248320, 5120)
    ids = torch.randint(0, 248320, (m,), device="cuda", dtype=torch.int32)
    out = torch.empty(m, 5120, device="cuda", dtype=torch.bfloat16)
    err = torch.zeros(1, device="cuda", dtype=torch.int32)
    bound = [k.bind({"ids": ids.data_ptr(), "table": table.data_ptr(), "out": out.data_ptr(), "err": err.data_ptr()},
                    {"M": m})] * 10
    us, peer_us = b.compare(b.ours(bound), b.peer([lambda: F.embedding(ids, table)] * 10))
    b.record("embedding", "v248320_h5120", f"M={m}", us, peer_us, "torch", 2 * m * 5120 * 2)
    del table
    # rope (q of the 27B: 24 heads of 256, first 64 dims rotate)
    k = b.lib.kernel("rope", "h24_d256")
    q = _bf16(torch, m, 24, 256)
    pos = torch.randint(0, 65536, (m,), device="cuda", dtype=torch.int32)
    cos, sin = _bf16(torch, 65536, 32), _bf16(torch, 65536, 32)
    bound = [k.bind({"x": q.data_ptr(), "positions": pos.data_ptr(), "cos": cos.data_ptr(), "sin": sin.data_ptr()},
                    {"M": m, "P": 65536})] * 10
    pl = pos.long()

    def torch_rope() -> None:
        c, s = cos[pl][:, None, :], sin[pl][:, None, :]
        x1, x2 = q[..., :32], q[..., 32:64]
        q[..., :64] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    us, peer_us = b.compare(b.ours(bound), b.peer([torch_rope] * 10))
    b.record("rope", "h24_d256", f"M={m}", us, peer_us, "torch", m * 24 * 64 * 2 * 2 + m * 64 * 2 * 2)


def bench_gemv(b: Bench, quick: bool) -> None:
    from cute_kernels import gemv

    torch = b.torch
    for name, n, k in gemv.SHAPES:
        if name.startswith("test_"):  # a test shape, not a model's
            continue
        wbytes = n * k * 2
        copies = max(1, min(8, -(-3 * L2_BYTES // wbytes)))
        ws = [_bf16(torch, n, k, scale=0.05) for _ in range(copies)]
        # M = 32 and 64: a verification step of 8 sequences (k = 3, 7) in one launch; the runner
        # ran it before as M / 8 launches of the M = 8 row.
        for m, mb in ((1, 8), (8, 8), (16, 16), (32, 32), (64, 64)):
            if quick and m >= 16:
                continue
            x = _bf16(torch, m, k)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            reps = max(copies, 8 // copies * copies)
            peer = [lambda i=i: torch.matmul(x, ws[i % copies].T) for i in range(reps)]
            # Every variant compiled for the shape and width, each row-group count (the `_rR` keys,
            # runtime/model/gpu/kernels.py GEMV_ROW_GROUPS) and any trial form added to
            # gemv.variants(), timed next to the others in the same run.
            for v in gemv.variants():
                if (v.config["N"], v.config["K"], v.config["MB"]) != (n, k, mb):
                    continue
                kern = b.lib.kernel("gemv", v.key)
                bound = [kern.bind({"x": x.data_ptr(), "w": ws[i % copies].data_ptr(), "out": out.data_ptr()},
                                   {"M": m}) for i in range(reps)]
                us, peer_us = b.compare(b.ours(bound), b.peer(peer))
                b.record("gemv", v.key, f"M={m} N={n} K={k}", us, peer_us, "cuBLAS", wbytes + m * (k + n) * 2)
        del ws


def bench_gemm(b: Bench, m: int) -> None:
    from cute_kernels import gemm_sm90

    torch = b.torch
    for v in gemm_sm90.variants():
        if v.key.startswith(("test_", "tiny_")) or v.config["ld"] != v.config["N"]:  # 27B shapes, no tails
            continue
        n, k = v.config["N"], v.config["K"]
        kern = b.lib.kernel("gemm_sm90", v.key)
        copies = 2
        xs = [_bf16(torch, m, k) for _ in range(copies)]
        ws = [_bf16(torch, n, k, scale=0.05) for _ in range(copies)]
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        bound = [kern.bind({"x": xs[i % 2].data_ptr(), "w": ws[i % 2].data_ptr(), "out": out.data_ptr()}, {"M": m})
                 for i in range(4)]
        peer = [lambda i=i: torch.matmul(xs[i % 2], ws[i % 2].T) for i in range(4)]
        us, peer_us = b.compare(b.ours(bound), b.peer(peer))
        b.record("gemm_sm90", v.key, f"M={m} N={n} K={k}", us, peer_us, "cuBLAS", flops=2.0 * m * n * k)
        del xs, ws, out


def _bench_moe(b: Bench) -> None:
    from .moe_forms import bench_moe  # the MoE layer's forms side by side

    bench_moe(b)


def bench_gdn(b: Bench) -> None:
    """The recurrent GDN kernels of the 27B shape at each column-block count side by side: decode
    (T = 1) and verification (T = 4, 8) at batch 1 and 8. Each of the graph's launches has its own
    state slots (pools of 3 MiB per sequence) so L2 cannot serve them, as in the model's 48 layers.
    Rates count the state read once and written once per token (a snapshot per verified token).
    No peer: torch has no fused delta-rule step."""
    from cute_kernels import gdn

    torch = b.torch
    reps = 8
    for batch, t in ((1, 1), (1, 4), (1, 8), (8, 1), (8, 4)):
        mode = "fused" if t == 1 else "verify"
        for v in gdn.variants():
            cfg = v.config
            if cfg["mode"] != mode or (cfg["Hk"], cfg["Hv"]) != (16, 48):
                continue
            hv, dv, dk = cfg["Hv"], cfg["dv"], cfg["dk"]
            m = batch * t
            per_launch = batch + (m if mode == "verify" else 0)  # own slots, then snapshots
            state = torch.zeros(reps * per_launch, hv, dv, dk, device="cuda", dtype=torch.float32)
            qkv, x = _bf16(torch, m, cfg["conv_dim"]), _bf16(torch, m, cfg["x_stride"])
            a_log, dt_bias, norm_w = _bf16(torch, hv), _bf16(torch, hv), _bf16(torch, dv)
            out = torch.empty(m, hv * dv, device="cuda", dtype=torch.bfloat16)
            # Each rep: its own slots, and (verify) its snapshot slots in their own 16-byte-aligned
            # buffer (the kernels load slot lists as vectors: a slice at `batch` would not be aligned).
            slots = [torch.arange(i * per_launch, i * per_launch + batch, device="cuda", dtype=torch.int32)
                     for i in range(reps)]
            snaps = [torch.arange(i * per_launch + batch, (i + 1) * per_launch, device="cuda", dtype=torch.int32)
                     if mode == "verify" else s for i, s in enumerate(slots)]
            kern = b.lib.kernel("gdn", v.key)
            bound = [kern.bind({"qkv": qkv.data_ptr(), "x": x.data_ptr(), "a_log": a_log.data_ptr(),
                                "dt_bias": dt_bias.data_ptr(), "norm_w": norm_w.data_ptr(), "state": state.data_ptr(),
                                "slots": s.data_ptr(), "slots_out": so.data_ptr(), "out": out.data_ptr()},
                               {"B": batch, "T": t, "NS": reps * per_launch}) for s, so in zip(slots, snaps)]
            us, _ = b.compare(b.ours(bound), None)
            b.record("gdn", v.key, f"B={batch} T={t}, {cfg['cols']} column block(s)", us, None, "",
                     batch * hv * dv * dk * 4 * (1 + t))
            del state


SECTIONS = ("norms", "elementwise", "gemv", "gemv_q", "gemm", "gemm_fp8", "moe", "gdn")


def run(out_dir: Path, quick: bool, rounds: int, only: tuple[str, ...] = SECTIONS,
        gemv_forms: tuple[str, ...] = ()) -> dict[str, Any]:
    b = Bench(rounds)
    t0 = time.perf_counter()
    b.measure_ceilings()
    print(json.dumps({"ceilings": b.ceilings}), flush=True)
    sections = [("norms", lambda: bench_norms(b, 8192)), ("norms", lambda: bench_norms(b, 1)),
                ("elementwise", lambda: bench_elementwise(b, 8192)), ("gemv", lambda: bench_gemv(b, quick)),
                ("gemv_q", lambda: bench_gemv_q(b, gemv_forms)), ("gemm", lambda: bench_gemm(b, 8192)),
                ("gemm_fp8", lambda: bench_gemm_fp8(b, 8192)), ("gemm_fp8", lambda: bench_gemm_fp8(b, 2048)),
                ("moe", lambda: _bench_moe(b)), ("moe", lambda: bench_moe_prefill(b)), ("gdn", lambda: bench_gdn(b))]
    for name, section in sections:
        if name not in only:
            continue
        try:
            section()
        except Exception as exc:  # keep the other sections' numbers
            print(f"section failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            b.results.append({"error": f"{type(exc).__name__}: {exc}"})
    report = {
        "command": "python -m bench.kernels " + " ".join(sys.argv[1:]),
        "hardware": b.device.describe(),
        "torch": b.torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "ceilings": b.ceilings,
        "results": b.results,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
    (out_dir / "kernels.md").write_text(render(report))
    return report


def render(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    c = report["ceilings"]
    drv = hw.get("driver")
    drv_text = f"CUDA driver API {drv // 1000}.{drv % 1000 // 10}" if isinstance(drv, int) else f"driver {drv}"
    lines = [
        f"Measured {report['date']} on {hw['name']} ({drv_text}, {hw.get('sms')} SMs), torch "
        f"{report['torch']} as the peer; command: `{report['command']}`.",
        "",
        f"Ceilings in the same run: copy bandwidth **{c['copy_TBps']:.2f} TB/s** (read + write), "
        f"bf16 matrix rate **{c['bf16_TFLOPs']:.0f} TFLOP/s** (torch.matmul 8192^3).",
        "",
        "| kernel | case | ours (us) | ours | of ceiling | peer | peer (us) | ours vs peer |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| error | {r['error']} | | | | | | |")
            continue
        rate = f"{r['TBps']:.2f} TB/s" if "TBps" in r else f"{r['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in r else ""
        frac = r.get("of_copy_bw", r.get("of_matrix_rate"))
        # One-row launches are latency, not bandwidth: a fraction of the ceiling means nothing there
        # (and a step with no byte or FLOP count, such as a routing kernel, has none).
        frac_text = "" if frac is None else "latency" if frac < 0.05 else f"{frac:.0%}"
        peer_us = "" if r["peer_us"] is None else f"{r['peer_us']:.1f}"
        speed = "" if "speedup_vs_peer" not in r else f"{r['speedup_vs_peer']:.2f}x"
        lines.append(f"| {r['family']}/{r['key']} | {r['case']} | {r['us']:.1f} | {rate} | {frac_text} | {r['peer']} | "
                     f"{peer_us} | {speed} |")
    lines.append("")
    lines.append("`ours vs peer` is peer time / our time (above 1 means we are faster). Rates count the bytes a "
                 "kernel must move (weights, activations in and out) or 2MNK FLOPs.")
    return "\n".join(lines) + "\n"


def update_doc(doc: Path, table: str) -> None:
    text = doc.read_text() if doc.exists() else "# Performance\n"
    block = f"{DOC_BEGIN}\n{table}{DOC_END}"
    if DOC_BEGIN in text and DOC_END in text:
        head, rest = text.split(DOC_BEGIN, 1)
        _, tail = rest.split(DOC_END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n## Kernels\n\n" + block + "\n"
    doc.write_text(text)


def _sections(ap: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        ap.error(f"--only takes a comma-separated subset of {','.join(SECTIONS)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kernel microbenchmarks against peers and ceilings.")
    ap.add_argument("--out", type=Path, default=Path("results"), help="folder for kernels.json and kernels.md")
    ap.add_argument("--quick", action="store_true", help="skip the GEMV cases of M >= 16")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per comparison (median reported)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default all)")
    ap.add_argument("--gemv-forms", default="",
                    help="comma-separated decode forms timed by gemv_q (default: every form built)")
    ap.add_argument("--render", type=Path, help="render an existing kernels.json instead of measuring")
    ap.add_argument("--update-doc", type=Path, help="replace the kernel table in this Markdown file")
    args = ap.parse_args(argv)
    forms = tuple(f for f in args.gemv_forms.split(",") if f)
    report = (json.loads(args.render.read_text()) if args.render
              else run(args.out, args.quick, args.rounds, _sections(ap, args.only), forms))
    if args.update_doc:
        update_doc(args.update_doc, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
