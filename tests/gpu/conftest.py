"""Fixtures for GPU kernel tests: one device, the kernel library, a stream, bf16 transfers.

The top-level conftest skips every `gpu`-marked test (with the reason) where no GPU is usable;
these fixtures additionally skip when no kernels were built for the device's arch.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import bf16


@pytest.fixture(scope="session")
def device():
    from runtime.cuda.device import CudaDevice

    return CudaDevice(0)


@pytest.fixture(scope="session")
def library(device):
    from runtime.cuda.kernels import KernelLibrary, default_build_dir
    from runtime.cuda.manifest import ManifestError

    try:
        return KernelLibrary.open(device, required=[])
    except ManifestError as exc:
        pytest.skip(f"no kernels built for {device.arch} under {default_build_dir()}: {exc}")


@pytest.fixture(scope="session")
def stream(device):
    return device.create_stream()


class Mem:
    """Allocate device buffers for one test, upload/download bf16 and int32, free at the end."""

    POISON = 0xFFFF  # a bf16 NaN: any element a kernel forgets to write stays NaN

    def __init__(self, device, stream):
        self.device = device
        self.stream = stream
        self.ptrs: list[int] = []

    def alloc(self, nbytes: int) -> int:
        ptr = self.device.mem_alloc(nbytes, "test buffer")
        self.ptrs.append(ptr)
        return ptr

    def raw(self, values: np.ndarray) -> int:
        """A device copy of the array's bytes as they are (codes, scales, pools; at least 16
        bytes allocated, so an empty array still gets a valid address)."""
        arr = np.ascontiguousarray(values)
        ptr = self.alloc(max(arr.nbytes, 16))
        self.device.memcpy_htod(ptr, arr, self.stream)
        self.stream.synchronize()
        return ptr

    def bf16(self, values: np.ndarray) -> int:
        return self.raw(bf16.to_bits(values))

    def i32(self, values: np.ndarray) -> int:
        return self.raw(np.asarray(values, dtype=np.int32))

    def poisoned(self, count: int) -> int:
        ptr = self.alloc(2 * count)
        self.device.memset_d16(ptr, self.POISON, count, self.stream)
        return ptr

    def read_bf16(self, ptr: int, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, np.uint16)
        self.stream.synchronize()
        self.device.memcpy_dtoh(out, ptr, self.stream)
        self.stream.synchronize()
        return bf16.from_bits(out)

    def read_f32(self, ptr: int, like: np.ndarray) -> np.ndarray:
        """A float32 array shaped like `like`, read from `ptr`."""
        out = np.empty_like(like, dtype=np.float32)
        self.stream.synchronize()
        self.device.memcpy_dtoh(out, ptr, self.stream)
        self.stream.synchronize()
        return out

    def read_i32(self, ptr: int, count: int) -> np.ndarray:
        out = np.empty(count, np.int32)
        self.stream.synchronize()
        self.device.memcpy_dtoh(out, ptr, self.stream)
        self.stream.synchronize()
        return out

    def free(self) -> None:
        self.stream.synchronize()
        for p in self.ptrs:
            self.device.mem_free(p)
        self.ptrs.clear()


@pytest.fixture
def mem(device, stream):
    m = Mem(device, stream)
    yield m
    m.free()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Relative Frobenius error in float64."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assert_equals_m8_rows(got, ref, m: int, what: str) -> None:
    """A wide GEMV launch's output `got` [m + 1, N] (poisoned first) against `ref`, the same rows
    from m8 launches: row m untouched, rows 0..m-1 all written and equal bit for bit."""
    assert np.isnan(got[m]).all(), f"{what}: wrote past row M"
    assert not np.isnan(got[:m]).any(), f"{what}: an output not written"
    diff = np.argwhere(got.view(np.uint32) != ref.view(np.uint32))
    assert diff.size == 0, (f"{what}: {len(diff)} elements differ from the m8 rows, first at "
                            f"{tuple(diff[0])}: {got[tuple(diff[0])]!r} vs {ref[tuple(diff[0])]!r}")


def assert_close_to_baseline(got, exact, baseline, what: str, slack: float = 2.0, floor: float = 1e-6) -> None:
    """The kernel's error against the exact result is at most `slack` times the error of a
    same-precision baseline (the bf16 model computed the reference way) plus a floor."""
    assert np.isfinite(got).all(), f"{what}: non-finite outputs (an element was not written?)"
    e_got, e_base = rel_err(got, exact), rel_err(baseline, exact)
    assert e_got <= slack * e_base + floor, f"{what}: error {e_got:.3e} vs baseline {e_base:.3e}"
