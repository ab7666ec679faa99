"""The decode GEMV and the prefill GEMM against references on a real GPU, plus graph replay.

Small problems use a float64 NumPy reference and a same-precision baseline (fp32 accumulate,
bf16 output). The full-size prefill shape uses torch on the same GPU as the peer: fp32 matmul
(TF32 off) as the reference, cuBLAS bf16 as the same-precision baseline.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_sm90, gemv, rmsnorm
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _gemv_key(name: str, mb: int) -> str:
    n, k = next((n, k) for nm, n, k in gemv.SHAPES if nm == name)
    return f"{name}_n{n}_k{k}_m{mb}"


@pytest.mark.parametrize(
    "name,mb,m", [("o_proj", 8, 1), ("o_proj", 8, 3), ("o_proj", 8, 8), ("down", 16, 9), ("gdn_in", 16, 16),
                  ("attn_qkv", 8, 5)]
)
def test_gemv(library, mem, stream, name, mb, m):
    n, k = next((n, k) for nm, n, k in gemv.SHAPES if nm == name)
    rng = np.random.default_rng(n + m)
    x = _bf(rng, (m, k))
    w = _bf(rng, (n, k), 0.05)
    x_buf, w_buf = mem.bf16(x), mem.bf16(w)
    want, base = gemv.reference(x, w, exact=True), gemv.reference(x, w)
    # Every compiled form of the shape (the default and any gemv.TRIALS form).
    for v in gemv.variants():
        if (v.config["N"], v.config["K"], v.config["MB"]) != (n, k, mb):
            continue
        out = mem.poisoned((m + 1) * n)
        library.kernel("gemv", v.key).launch(stream, {"x": x_buf, "w": w_buf, "out": out}, {"M": m})
        got = mem.read_bf16(out, (m + 1, n))
        assert np.isnan(got[m]).all(), f"{v.key} wrote past M"
        assert_close_to_baseline(got[:m], want, base, f"gemv {v.key} M={m}")


def test_gemv_rejects_large_m(library):
    from runtime.cuda.errors import LaunchError

    kernel = library.kernel("gemv", _gemv_key("o_proj", 8))
    with pytest.raises(LaunchError, match="M <= 8"):
        kernel.bind({"x": 256, "w": 256, "out": 256}, {"M": 9})


@pytest.mark.parametrize("m", [1, 64, 129, 300])
def test_gemm_small(library, mem, stream, m):
    key = next(v.key for v in gemm_sm90.variants() if v.key.startswith("test_"))
    kernel = library.kernel("gemm_sm90", key)
    n, k = kernel.entry.config["N"], kernel.entry.config["K"]
    rng = np.random.default_rng(m)
    x = _bf(rng, (m, k))
    w = _bf(rng, (n, k), 0.1)
    out = mem.poisoned((m + 1) * n)
    kernel.launch(stream, {"x": mem.bf16(x), "w": mem.bf16(w), "out": out}, {"M": m})
    got = mem.read_bf16(out, (m + 1, n))
    assert np.isnan(got[m]).all(), "wrote past M"
    assert_close_to_baseline(got[:m], gemm_sm90.reference(x, w, exact=True), gemm_sm90.reference(x, w),
                             f"gemm {key} M={m}")


@pytest.mark.parametrize("name,m", [("o_proj", 8192), ("gdn_in", 1000)])
def test_gemm_model_shapes(library, device, stream, name, m):
    torch = pytest.importorskip("torch")
    v = next(v for v in gemm_sm90.variants() if v.key.startswith(name + "_"))
    kernel = library.kernel("gemm_sm90", v.key)
    n, k = v.config["N"], v.config["K"]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    out = torch.full((m + 1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    kernel.launch(stream, {"x": x.data_ptr(), "w": w.data_ptr(), "out": out.data_ptr()}, {"M": m})
    stream.synchronize()
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = x.float() @ w.float().T
    base = (x @ w.T).float()
    got = out[:m].float()
    assert torch.isnan(out[m].float()).all()
    assert torch.isfinite(got).all()
    e_got = float(torch.linalg.norm(got - exact) / torch.linalg.norm(exact))
    e_base = float(torch.linalg.norm(base - exact) / torch.linalg.norm(exact))
    assert e_got <= 2 * e_base + 1e-6, f"gemm {v.key} M={m}: {e_got:.3e} vs cuBLAS {e_base:.3e}"


def test_graph_replay(library, device, mem, stream):
    """Norm -> GEMV -> GEMM captured in one graph; a replay after clearing the outputs
    reproduces the eager results bit for bit."""
    from runtime.cuda.device import capture_graph

    rng = np.random.default_rng(3)
    m, h = 4, 5120
    norm = library.kernel("rmsnorm", "zc_h5120")
    mv = library.kernel("gemv", _gemv_key("o_proj", 8))  # x [M, 6144]
    gemm_key = next(v.key for v in gemm_sm90.variants() if v.key.startswith("test_"))
    mm = library.kernel("gemm_sm90", gemm_key)
    n2, k2 = mm.entry.config["N"], mm.entry.config["K"]
    x = _bf(rng, (m, h))
    w = _bf(rng, (h,), 0.1)
    xv = _bf(rng, (m, 6144))
    wv = _bf(rng, (5120, 6144), 0.05)
    xg = _bf(rng, (m, k2))
    wg = _bf(rng, (n2, k2), 0.1)
    outs = {"norm": mem.alloc(m * h * 2), "gemv": mem.alloc(m * 5120 * 2), "gemm": mem.alloc(m * n2 * 2)}
    launches = [
        norm.bind({"x": mem.bf16(x), "w": mem.bf16(w), "out": outs["norm"]}, {"M": m}),
        mv.bind({"x": mem.bf16(xv), "w": mem.bf16(wv), "out": outs["gemv"]}, {"M": m}),
        mm.bind({"x": mem.bf16(xg), "w": mem.bf16(wg), "out": outs["gemm"]}, {"M": m}),
    ]
    for launch in launches:
        launch(stream)
    sizes = {"norm": (m, h), "gemv": (m, 5120), "gemm": (m, n2)}
    eager = {k: mem.read_bf16(p, sizes[k]) for k, p in outs.items()}
    graph = capture_graph(device, stream, lambda: [launch(stream) for launch in launches])
    assert graph.nodes == 3
    for k, p in outs.items():
        device.memset_d8(p, 0, int(np.prod(sizes[k])) * 2, stream)
    graph.replay(stream)
    for k, p in outs.items():
        np.testing.assert_array_equal(mem.read_bf16(p, sizes[k]), eager[k], err_msg=k)
    want, _ = rmsnorm.reference(x, w, exact=True)
    base, _ = rmsnorm.reference(x, w)
    assert_close_to_baseline(eager["norm"], want, base, "graph norm")
    graph.destroy()
