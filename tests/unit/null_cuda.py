"""A `CudaRunner` on the null device for host-side tests (no tests here; test files import it).

The runner reads the built manifest and cubins even though nothing runs, so every such test
skips, with the reason, where the kernels are not built or the build is stale or partial.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def built_or_skip(make: Callable[[], T]) -> T:
    """`make()` (which builds a runner on the null device), or a skip naming why it cannot."""
    from runtime.cuda.manifest import ManifestError

    if not (REPO / "build" / "kernels" / "sm_90a" / "manifest.json").exists():
        pytest.skip("kernels not built (python build_kernels.py --arch sm_90a)")
    try:
        return make()
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    except Exception as exc:  # a stale or partial build
        if type(exc).__name__ in ("KernelMissing", "KernelStale"):
            pytest.skip(str(exc))
        raise


def null_runner(path: Path):
    """The CUDA runner of the artifact at `path` on a 2 GiB null device (2 slots, 16 pages,
    64-token pieces), or a skip without built kernels."""
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    return built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=16, num_slots=2,
                                                          device=NullDevice(total_memory=2 << 30),
                                                          prefill_chunk=64))


def family_launches(launches, family: str) -> list[tuple[str, list[int], int]]:
    """(key, pointer parameters, M) of every recorded launch of `family`'s kernels, in order (M is
    the last parameter; the pointers are the 8-byte parameters before it, so a GEMM's TMA
    descriptors and int32 sizes are left out)."""
    prefix = f"infx_{family}_"
    out = []
    for rec in launches:
        if rec.function.startswith(prefix):
            key = rec.function[len(prefix):].split("_kernel")[0]
            ptrs = [struct.unpack("<Q", p)[0] for p in rec.params[:-1] if len(p) == 8]
            out.append((key, ptrs, struct.unpack("<i", rec.params[-1])[0]))
    return out
