"""Embedding gather: `out[m] = table[ids[m]]` for bf16 tables.

An id outside `[0, V)` never reads out of bounds: its output row is written as zeros and the
int32 error flag `err[0]` is set to 1, which the runtime turns into a failed request (the flag is
cleared by the runtime before the step; the kernel only ever sets it). One CTA copies one row
with 16-byte vector loads; M (tokens) is dynamic.
"""

from typing import Any

import numpy as np

from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "embedding"
THREADS = 128

_SHAPES = [("v248320_h5120", 248320, 5120), ("v248320_h2048", 248320, 2048), ("v151936_h2048", 151936, 2048),
           ("v512_h256", 512, 256)]  # the last: the tiny test model (tools/make_tiny.py)


def _variant(key: str, vocab: int, h: int) -> Variant:
    threads = min(THREADS, h // 8)  # 8 bf16 (16 bytes) per thread and vector
    return Variant(
        family=FAMILY,
        key=key,
        config={"V": vocab, "H": h, "threads": threads},
        params=[ptr("ids"), ptr("table"), ptr("out"), ptr("err"), i32("M")],
        tensors={
            "ids": tensor("i32", "M"),
            "table": tensor("bf16", vocab, h),
            "out": tensor("bf16", "M", h, role="out"),
            "err": tensor("i32", 1, role="inout"),
        },
        sizes=("M",),
        block=(threads, 1, 1),
        grid=("M", 1, 1),
        requires=("M >= 1",),
        arches=ALL_ARCHES,
        note=f"gather rows of a {vocab}x{h} bf16 table, flagging bad ids",
        example_sizes={"M": 8192},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in _SHAPES]


def reference(ids: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, bool]:
    """(rows, error) where rows of out-of-range ids are zero and error says whether any was."""
    ids = np.asarray(ids, dtype=np.int64)
    ok = (ids >= 0) & (ids < table.shape[0])
    out = np.zeros((ids.shape[0], table.shape[1]), dtype=table.dtype)
    out[ok] = table[ids[ok]]
    return out, bool((~ok).any())


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    vocab, h, threads = variant.config["V"], variant.config["H"], variant.config["threads"]
    vecs = h // (8 * threads)
    if h % (8 * threads):
        raise ValueError(f"{variant.name}: H={h} must be a multiple of {8 * threads}")

    @cute.kernel
    def kernel(ids: cute.Pointer, table: cute.Pointer, out: cute.Pointer, err: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        layout = cute.make_layout((8, vecs, threads), stride=(1, threads * 8, 8))
        gids = cute.make_tensor(ids, cute.make_layout(m))
        token = gids[row]
        gout = cute.make_tensor(out + cutlass.Int64(row) * h, layout)
        if token >= 0 and token < vocab:
            gsrc = cute.make_tensor(table + cutlass.Int64(token) * h, layout)
            for v in cutlass.range_constexpr(vecs):
                gout[None, v, tid].store(gsrc[None, v, tid].load())
        else:
            zeros = cute.make_rmem_tensor((8,), cutlass.BFloat16)
            zeros.fill(0.0)
            for v in cutlass.range_constexpr(vecs):
                gout[None, v, tid].store(zeros.load())
            if tid == 0:
                gerr = cute.make_tensor(err, cute.make_layout(1))
                gerr[0] = cutlass.Int32(1)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_embedding_{variant.key}")

    @cute.jit
    def launch(ids: cute.Pointer, table: cute.Pointer, out: cute.Pointer, err: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(ids, table, out, err, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"ids": 4, "err": 4})
