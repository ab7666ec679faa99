"""A `CudaRunner` on the null device for host-side tests (no tests here; test files import it).

The runner reads the built manifest and cubins even though nothing runs, so every such test
skips, with the reason, where the kernels are not built or the build is stale or partial.
"""

from __future__ import annotations

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
