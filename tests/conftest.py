"""Shared pytest set-up: the `gpu` marker skips (with the reason) where no usable GPU exists."""

from __future__ import annotations

import ctypes.util
import os

import pytest


def _gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when a CUDA driver and a device are present."""
    if os.environ.get("INFERNIX_SKIP_GPU_TESTS"):
        return "INFERNIX_SKIP_GPU_TESTS is set"
    if ctypes.util.find_library("cuda") is None:
        return "no CUDA driver (libcuda) on this machine"
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return f"cuda-bindings not importable: {exc}"
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name}"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device visible"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
