"""Typed errors of the CUDA layer. Every message names what failed and, where it applies, the
kernel (family/key), the driver call and the driver's own error string."""

from __future__ import annotations

__all__ = [
    "CudaError",
    "CudaUnavailable",
    "DeviceOutOfMemory",
    "KernelMissing",
    "KernelStale",
    "LaunchError",
    "SyncPolicyError",
    "GIB",
    "gib",
]

GIB = float(1 << 30)


def gib(nbytes: int | float) -> str:
    """Bytes as GiB with two decimals, the unit every memory message uses."""
    return f"{nbytes / GIB:.2f} GiB"


class CudaError(RuntimeError):
    """A driver call failed. `call` is the driver function, `code` the CUresult name."""

    def __init__(self, message: str, call: str = "", code: str = ""):
        super().__init__(message)
        self.call = call
        self.code = code


class CudaUnavailable(CudaError):
    """No usable driver or device (no libcuda, no GPU, bad --device)."""


class DeviceOutOfMemory(CudaError):
    """A device allocation or arena reservation did not fit."""


class SyncPolicyError(ValueError):
    """INFERNIX_CUDA_SYNC has an empty or unknown value."""


class KernelMissing(LookupError):
    """A kernel the runtime needs is not in the manifest (never built for this arch)."""


class KernelStale(RuntimeError):
    """A kernel's cubin or manifest entry does not match the current sources."""


class LaunchError(ValueError):
    """A launch was asked with missing or out-of-range sizes or buffers."""
