"""What a kernel family declares about each compiled variant (pure Python, no DSL import).

A family module (`rmsnorm.py`, `gemm_sm90.py`, ...) exposes:

- `FAMILY`: its name;
- `variants()`: the `Variant`s to build (shapes/dtypes/tiles for the models we serve);
- `reference(...)`: the NumPy reference used by tests and benchmarks;
- `build(variant)`: returns `(jit_function, example_args)` for `cute.compile`; it imports the
  CuTe DSL itself, so `variants()` and `reference()` work on machines without the DSL.

A `Variant` states the kernel's whole launch ABI: the parameter list in entry order (pointers,
int32 sizes or derived scalars as formulas, TMA descriptors with their encode settings), the
buffers with dtypes and shapes, the block, the grid rule, the cluster, and the launch
constraints. `build_kernels.py` checks the compiled PTX and host IR against it and fails, naming
the kernel, on any mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.cuda.manifest import Param, TensorSpec, TmaEncode

__all__ = ["Variant", "ptr", "i32", "f32", "tma", "tensor", "ALL_ARCHES", "HOPPER"]

HOPPER = ("sm_90a",)
# Plain SIMT kernels (no wgmma/TMA) compile for every target we build.
ALL_ARCHES = ("sm_90a", "sm_100a", "sm_120a")


def ptr(name: str, buffer: str | None = None) -> Param:
    """The device address of a buffer."""
    return Param(kind="ptr", name=name, size=8, align=8, buffer=buffer or name)


def i32(name: str, value: str | int | None = None) -> Param:
    """An int32 size (value defaults to the size of the same name) or a derived scalar formula."""
    return Param(kind="i32", name=name, size=4, align=4, value=name if value is None else value)


def f32(name: str, value: str | float) -> Param:
    return Param(kind="f32", name=name, size=4, align=4, value=value)


def tma(name: str, buffer: str, encode: TmaEncode) -> Param:
    return Param(kind="tma", name=name, size=128, align=64, buffer=buffer, encode=encode)


def tensor(dtype: str, *shape: str | int, role: str = "in") -> TensorSpec:
    return TensorSpec(dtype=dtype, shape=tuple(shape), role=role)


@dataclass(frozen=True)
class Variant:
    """One compiled instance of a kernel family."""

    family: str
    key: str
    config: Mapping[str, Any]  # compile-time parameters; part of the fingerprint
    params: Sequence[Param]  # kernel entry parameters, in order
    tensors: Mapping[str, TensorSpec]
    sizes: Sequence[str]  # runtime sizes the caller passes (e.g. "M")
    block: tuple[int, int, int]
    grid: tuple[str | int, str | int, str | int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    requires: Sequence[str] = ()  # formulas that must hold at launch, e.g. "M <= 16"
    arches: Sequence[str] = HOPPER
    extra_sources: Sequence[str] = ()  # repo-relative files besides the family module
    note: str = ""  # one line for `--list` and docs
    example_sizes: Mapping[str, int] = field(default_factory=dict)  # for benchmarks and docs

    @property
    def name(self) -> str:
        return f"{self.family}/{self.key}"
