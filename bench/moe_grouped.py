"""The prefill MoE kernels (cute_kernels/moe_grouped.py) in `bench.kernels --only moe`.

One 35B-A3B MoE layer over a 2,048-row prefill chunk with the routing of random hidden rows
(near-uniform: ~64 rows per routed expert, the shared expert taking all 2,048): each launch of the
chain timed on its own (graphs of that launch alone, repeated), then the whole chain (router
logits and routing of the `moe` family, perm, gather, gate/up GEMM, SwiGLU, down GEMM, combine).
The grouped GEMMs are rated by the FLOPs of the tiles in use (padding included, what the tensor
cores run) against cuBLAS on one dense GEMM of the same rows, N and K (its weights fit L2, ours
are 257 experts read from HBM: a rate ceiling, not a like-for-like peer); the rest by the bytes
they move.
"""

from __future__ import annotations

from typing import Any


def bench_moe_prefill(b: Any, m: int = 2048) -> None:
    from cute_kernels import moe, moe_grouped

    from bench.kernels import _bf16

    torch = b.torch
    _, h, e, k, inter = next(shape for shape in moe_grouped.SHAPES if shape[0] == "a3b")
    p = k + 1
    c = moe_grouped.capacity(m, p, e + 1)
    keys = {v.config["kind"]: v.key for v in moe.variants() if (v.config["H"], v.config["E"]) == (h, e)}
    grouped = {(v.config["kind"], v.config.get("proj")): v.key for v in moe_grouped.variants()
               if (v.config.get("H"), v.config.get("E")) == (h, e) or v.config.get("E1") == e + 1}
    router = _bf16(torch, e, h, scale=h ** -0.5)
    w_sg = _bf16(torch, h, scale=h ** -0.5)
    gate_up = _bf16(torch, (e + 1) * 2 * inter, h, scale=h ** -0.5)
    down = _bf16(torch, (e + 1) * h, inter, scale=inter ** -0.5)
    x = _bf16(torch, m, h)

    def empty(*shape: int, dtype: Any) -> Any:
        return torch.empty(*shape, device="cuda", dtype=dtype)

    t = {"logits": empty(m, e, dtype=torch.float32), "ids": empty(m, p, dtype=torch.int32),
         "wts": empty(m, p, dtype=torch.float32), "pos": empty(m, p, dtype=torch.int32),
         "src": empty(c, dtype=torch.int32), "tiles": empty(c // moe_grouped.BM + 1, dtype=torch.int32),
         "rows": empty(c, h, dtype=torch.float32), "gu": empty(c, 2 * inter, dtype=torch.bfloat16),
         "act": empty(c, inter, dtype=torch.bfloat16), "out": empty(m, h, dtype=torch.bfloat16)}
    a = {name: tensor.data_ptr() for name, tensor in t.items()}
    lib, rows = b.lib, {"M": m, "C": c}
    chain = [
        ("logits", lib.kernel("moe", keys["logits"]).bind({"x": x.data_ptr(), "w": router.data_ptr(),
                                                          "out": a["logits"]}, {"M": m})),
        ("route", lib.kernel("moe", keys["route"]).bind({"logits": a["logits"], "x": x.data_ptr(),
                                                        "w_sg": w_sg.data_ptr(), "ids": a["ids"], "wts": a["wts"]},
                                                       {"M": m})),
        ("perm", lib.kernel("moe_grouped", grouped[("perm", None)]).bind(
            {"ids": a["ids"], "pos": a["pos"], "src": a["src"], "tiles": a["tiles"]}, rows)),
        ("gather", lib.kernel("moe_grouped", grouped[("gather", None)]).bind(
            {"x": x.data_ptr(), "src": a["src"], "tiles": a["tiles"], "xg": a["rows"]}, rows)),
        ("gemm_gate_up", lib.kernel("moe_grouped", grouped[("gemm", "gate_up")]).bind(
            {"x": a["rows"], "w": gate_up.data_ptr(), "tiles": a["tiles"], "out": a["gu"]}, {"C": c})),
        ("silu_mul", lib.kernel("silu_mul", f"i{inter}").bind({"x": a["gu"], "out": a["act"]}, {"M": c})),
        ("gemm_down", lib.kernel("moe_grouped", grouped[("gemm", "down")]).bind(
            {"x": a["act"], "w": down.data_ptr(), "tiles": a["tiles"], "out": a["rows"]}, {"C": c})),
        ("combine", lib.kernel("moe_grouped", grouped[("combine", None)]).bind(
            {"dn": a["rows"], "pos": a["pos"], "wts": a["wts"], "out": a["out"]}, rows)),
    ]
    for _, launch in chain:  # one pass so every buffer (the tile list above all) holds real values
        launch(b.stream)
    b.stream.synchronize()
    used = int(t["tiles"][0].item()) * moe_grouped.BM

    us, _ = b.compare(b.ours([launch for _, launch in chain]), None)
    b.record("moe_grouped", "layer_a3b", f"M={m} prefill, {used} rows in {used // moe_grouped.BM} tiles (C={c})",
             us * len(chain), None, "", (e + 1) * 3 * inter * h * 2)
    for name, launch in chain:
        single, peer_us, peer, flops, nbytes = b.ours([launch] * 4), None, "", 0.0, 0.0
        if name.startswith("gemm"):
            n_, k_ = (2 * inter, h) if name == "gemm_gate_up" else (h, inter)
            xa, wa = _bf16(torch, used, k_), _bf16(torch, n_, k_)
            us, peer_us = b.compare(single, b.peer([lambda: torch.matmul(xa, wa.T)] * 4))
            peer, flops = "cuBLAS dense, same M N K", 2.0 * used * n_ * k_
        else:
            us, _ = b.compare(single, None)
            nbytes = {"gather": 2 * used * h * 2, "combine": m * p * h * 4 + m * h * 2,
                      "silu_mul": c * 3 * inter * 2}.get(name, 0.0)
        b.record("moe_grouped", name, f"M={m} prefill (a3b)", us, peer_us, peer, nbytes, flops)
