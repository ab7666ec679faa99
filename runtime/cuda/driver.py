"""Checked driver calls: the single place that turns a CUresult into an exception.

`call("cuMemAlloc", nbytes)` runs `cuda.bindings.driver.cuMemAlloc(nbytes)`, raises `CudaError`
naming the call and the driver's error name and string when it fails, and otherwise returns the
call's results (None, one value, or a tuple).
"""

from __future__ import annotations

import functools
from typing import Any

from .errors import CudaError, CudaUnavailable

__all__ = ["bindings", "check", "call"]


@functools.cache
def bindings() -> Any:
    """The `cuda.bindings.driver` module, imported on first use."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a hard dependency
        raise CudaUnavailable(f"cuda-bindings is not importable: {exc}") from None
    return driver


def _error_text(drv: Any, err: Any) -> str:
    try:
        name = drv.cuGetErrorName(err)[1].decode()
        text = drv.cuGetErrorString(err)[1].decode()
        return f"{name} ({text})"
    except Exception:  # the driver itself may be what is missing
        return getattr(err, "name", str(err))


def check(result: Any, call_name: str) -> Any:
    """Unpack a cuda-python result tuple `(CUresult, *values)`; raise on failure."""
    drv = bindings()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        code = getattr(err, "name", str(err))
        message = f"{call_name} failed: {_error_text(drv, err)}"
        if code == "CUDA_ERROR_OUT_OF_MEMORY":
            from .errors import DeviceOutOfMemory

            raise DeviceOutOfMemory(message, call_name, code)
        raise CudaError(message, call_name, code)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(name: str, *args: Any) -> Any:
    """Run driver function `name` with `args` and check its result."""
    drv = bindings()
    try:
        fn = getattr(drv, name)
    except AttributeError:
        raise CudaUnavailable(f"this cuda-bindings has no {name}") from None
    try:
        result = fn(*args)
    except CudaError:
        raise
    except RuntimeError as exc:  # cuda-bindings raises when libcuda cannot be loaded
        raise CudaUnavailable(f"{name}: no usable CUDA driver ({exc})", name) from None
    except Exception as exc:
        if type(exc).__name__ == "DynamicLibNotFoundError":
            raise CudaUnavailable(f"{name}: no CUDA driver on this machine ({exc})", name) from None
        raise
    return check(result, name)
