"""The kernel manifest: what `build_kernels.py` writes and the runtime reads.

One `build/kernels/<arch>/manifest.json` per architecture describes every compiled kernel well
enough that the runtime can launch it without the CuTe DSL: the cubin and its entry symbol, each
kernel parameter (a buffer pointer, a TMA descriptor with the exact `cuTensorMapEncodeTiled`
settings, an int32 size or derived scalar given as a formula, a constant), the block, the grid
rule, the cluster shape, the dynamic shared memory, the buffers' dtypes and shapes, and the
fingerprint of the sources it was built from.

This module is pure Python (json + hashlib): the build script, the runtime and CPU tests share it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .expr import Formula, FormulaError

__all__ = [
    "SCHEMA_VERSION",
    "DTYPE_BYTES",
    "ManifestError",
    "TmaEncode",
    "Param",
    "TensorSpec",
    "KernelEntry",
    "Manifest",
    "file_sha256",
    "source_hashes",
    "variant_fingerprint",
]

SCHEMA_VERSION = 1

# Element sizes of the dtype names used in manifests.
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "e4m3": 1}

# cuTensorMapEncodeTiled data types per element dtype (fp8 is encoded as UINT8).
TMA_DTYPE = {"bf16": "BFLOAT16", "f16": "FLOAT16", "f32": "FLOAT32", "e4m3": "UINT8", "u8": "UINT8"}

_PARAM_SIZES = {"ptr": (8, 8), "i32": (4, 4), "f32": (4, 4), "tma": (128, 64)}
_SWIZZLES = {"NONE", "32B", "64B", "128B"}
_L2 = {"NONE", "L2_64B", "L2_128B", "L2_256B"}
_OOB = {"NONE", "NAN_REQUEST_ZERO_FMA"}


class ManifestError(RuntimeError):
    """The manifest is missing, unreadable, or describes something the runtime cannot launch."""


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ManifestError(f"{where}: {what}")


def _formula(value: Any, where: str) -> str | int:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ManifestError(f"{where}: {value!r} is not a number or formula")
    if isinstance(value, str):
        try:
            Formula(value)
        except FormulaError as exc:
            raise ManifestError(f"{where}: {exc}") from None
    return value


@dataclass(frozen=True)
class TmaEncode:
    """Arguments of `cuTensorMapEncodeTiled` for one TMA descriptor parameter.

    `dims` and `strides_bytes` are formulas over the kernel's sizes, innermost dimension first
    (the driver's order); `strides_bytes` has rank-1 entries (the innermost stride is implied).
    """

    dtype: str  # CUtensorMapDataType suffix, e.g. "BFLOAT16"
    dims: tuple[str | int, ...]
    strides_bytes: tuple[str | int, ...]
    box: tuple[int, ...]
    elem_strides: tuple[int, ...]
    swizzle: str = "128B"  # CUtensorMapSwizzle suffix
    l2: str = "L2_128B"  # CUtensorMapL2promotion suffix
    oob: str = "NONE"  # CUtensorMapFloatOOBfill suffix
    interleave: str = "NONE"

    @property
    def rank(self) -> int:
        return len(self.dims)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "rank": self.rank,
            "dims": list(self.dims),
            "strides_bytes": list(self.strides_bytes),
            "box": list(self.box),
            "elem_strides": list(self.elem_strides),
            "swizzle": self.swizzle,
            "l2": self.l2,
            "oob": self.oob,
            "interleave": self.interleave,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> TmaEncode:
        try:
            enc = cls(
                dtype=str(d["dtype"]),
                dims=tuple(_formula(x, where + ".dims") for x in d["dims"]),
                strides_bytes=tuple(_formula(x, where + ".strides_bytes") for x in d["strides_bytes"]),
                box=tuple(int(x) for x in d["box"]),
                elem_strides=tuple(int(x) for x in d["elem_strides"]),
                swizzle=str(d.get("swizzle", "128B")),
                l2=str(d.get("l2", "L2_128B")),
                oob=str(d.get("oob", "NONE")),
                interleave=str(d.get("interleave", "NONE")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: malformed TMA encode settings ({exc})") from None
        enc.validate(where)
        return enc

    def validate(self, where: str) -> None:
        r = self.rank
        _need(1 <= r <= 5, where, f"TMA rank {r} outside 1..5")
        _need(self.dtype in set(TMA_DTYPE.values()), where, f"TMA dtype {self.dtype!r} unknown")
        _need(len(self.strides_bytes) == r - 1, where, "TMA needs rank-1 byte strides")
        _need(len(self.box) == r and all(1 <= b <= 256 for b in self.box), where, f"TMA box {self.box} invalid")
        _need(len(self.elem_strides) == r, where, "TMA elem_strides must have one entry per dim")
        _need(self.swizzle in _SWIZZLES, where, f"TMA swizzle {self.swizzle!r} unknown")
        _need(self.l2 in _L2, where, f"TMA L2 promotion {self.l2!r} unknown")
        _need(self.oob in _OOB, where, f"TMA OOB fill {self.oob!r} unknown")


@dataclass(frozen=True)
class Param:
    """One kernel parameter, in entry order.

    kind is one of:
      - "ptr": the device address of buffer `buffer` (8 bytes);
      - "i32": an int32 whose `value` is a formula over sizes (a size, or a derived scalar);
      - "f32": a float32 whose `value` is a formula over sizes or a literal;
      - "tma": a 128-byte TMA descriptor of buffer `buffer`, encoded with `encode`;
      - "const": fixed bytes `hex` (placeholders the DSL leaves for static-only arguments).
    """

    kind: str
    name: str
    size: int
    align: int
    buffer: str | None = None
    value: str | int | float | None = None
    encode: TmaEncode | None = None
    hex: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "name": self.name, "size": self.size, "align": self.align}
        if self.buffer is not None:
            d["buffer"] = self.buffer
        if self.value is not None:
            d["value"] = self.value
        if self.encode is not None:
            d["encode"] = self.encode.to_json()
        if self.hex is not None:
            d["hex"] = self.hex
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> Param:
        kind = d.get("kind")
        _need(kind in ("ptr", "i32", "f32", "tma", "const"), where, f"unknown parameter kind {kind!r}")
        name = str(d.get("name", ""))
        size, align = int(d.get("size", -1)), int(d.get("align", -1))
        if kind in _PARAM_SIZES:
            want = _PARAM_SIZES[kind]
            _need((size, align) == want, where, f"{kind} parameter must be {want[0]} bytes aligned {want[1]}")
        p = cls(
            kind=kind,
            name=name,
            size=size,
            align=align,
            buffer=d.get("buffer"),
            value=_formula(d["value"], where) if "value" in d else None,
            encode=TmaEncode.from_json(d["encode"], where + ".encode") if "encode" in d else None,
            hex=d.get("hex"),
        )
        if kind in ("ptr", "tma"):
            _need(isinstance(p.buffer, str), where, f"{kind} parameter needs a buffer name")
        if kind == "tma":
            _need(p.encode is not None, where, "tma parameter needs encode settings")
        if kind in ("i32", "f32"):
            _need(p.value is not None, where, f"{kind} parameter needs a value formula")
        if kind == "const":
            _need(isinstance(p.hex, str) and len(p.hex) == 2 * size, where, "const parameter needs size bytes of hex")
        return p


@dataclass(frozen=True)
class TensorSpec:
    """A buffer the kernel reads or writes: dtype and row-major shape (formulas over sizes)."""

    dtype: str
    shape: tuple[str | int, ...]
    role: str = "in"  # "in", "out" or "inout"

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "role": self.role}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> TensorSpec:
        dtype = d.get("dtype")
        _need(dtype in DTYPE_BYTES, where, f"unknown dtype {dtype!r}")
        role = d.get("role", "in")
        _need(role in ("in", "out", "inout"), where, f"unknown role {role!r}")
        return cls(dtype=dtype, shape=tuple(_formula(x, where + ".shape") for x in d.get("shape", [])), role=role)


@dataclass(frozen=True)
class KernelEntry:
    """Everything needed to load and launch one compiled kernel variant."""

    family: str
    key: str
    entry: str
    cubin: str  # path relative to the manifest's folder
    cubin_sha256: str
    fingerprint: str
    sources: Mapping[str, str]  # source path (relative to the repo) -> sha256
    params: tuple[Param, ...]
    block: tuple[int, int, int]
    grid: tuple[str | int, str | int, str | int]
    cluster: tuple[int, int, int]
    dynamic_smem: int
    tensors: Mapping[str, TensorSpec]
    sizes: tuple[str, ...]
    requires: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    build: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.family}/{self.key}"

    @property
    def pdl(self) -> bool:
        """Built with config `pdl: True`: the kernel executes `griddepcontrol.wait` before touching
        what earlier kernels write (build_kernels.py checks the PTX), so it may be launched with
        programmatic stream serialization (cute_kernels/_pdl.py)."""
        return bool(self.config.get("pdl", False))

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "key": self.key,
            "entry": self.entry,
            "cubin": self.cubin,
            "cubin_sha256": self.cubin_sha256,
            "fingerprint": self.fingerprint,
            "sources": dict(self.sources),
            "params": [p.to_json() for p in self.params],
            "block": list(self.block),
            "grid": list(self.grid),
            "cluster": list(self.cluster),
            "dynamic_smem": self.dynamic_smem,
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "sizes": list(self.sizes),
            "requires": list(self.requires),
            "config": dict(self.config),
            "build": dict(self.build),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> KernelEntry:
        try:
            family, key = str(d["family"]), str(d["key"])
            where = f"{where} ({family}/{key})"
            params = tuple(Param.from_json(p, f"{where} param {i}") for i, p in enumerate(d["params"]))
            tensors = {str(k): TensorSpec.from_json(v, f"{where} tensor {k}") for k, v in d["tensors"].items()}
            entry = cls(
                family=family,
                key=key,
                entry=str(d["entry"]),
                cubin=str(d["cubin"]),
                cubin_sha256=str(d["cubin_sha256"]),
                fingerprint=str(d["fingerprint"]),
                sources={str(k): str(v) for k, v in d["sources"].items()},
                params=params,
                block=tuple(int(x) for x in d["block"]),  # type: ignore[arg-type]
                grid=tuple(_formula(x, where + ".grid") for x in d["grid"]),  # type: ignore[arg-type]
                cluster=tuple(int(x) for x in d.get("cluster", (1, 1, 1))),  # type: ignore[arg-type]
                dynamic_smem=int(d.get("dynamic_smem", 0)),
                tensors=tensors,
                sizes=tuple(str(s) for s in d.get("sizes", ())),
                requires=tuple(str(_formula(r, where + ".requires")) for r in d.get("requires", ())),
                config=dict(d.get("config", {})),
                build=dict(d.get("build", {})),
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: malformed kernel entry ({type(exc).__name__}: {exc})") from None
        entry.validate(where)
        return entry

    def validate(self, where: str) -> None:
        _need(len(self.block) == 3 and all(b >= 1 for b in self.block), where, "block must be 3 positive ints")
        _need(self.block[0] * self.block[1] * self.block[2] <= 1024, where, "block exceeds 1024 threads")
        _need(len(self.grid) == 3, where, "grid must have 3 entries")
        _need(len(self.cluster) == 3 and all(c >= 1 for c in self.cluster), where, "cluster must be 3 positive ints")
        _need(0 <= self.dynamic_smem <= 232448, where, f"dynamic smem {self.dynamic_smem} exceeds 227 KiB")
        known = set(self.sizes)
        for i, p in enumerate(self.params):
            if p.buffer is not None:
                _need(p.buffer in self.tensors, where, f"param {i} names unknown buffer {p.buffer!r}")
        for text in [*self.grid, *self.requires, *(p.value for p in self.params if p.value is not None)]:
            if isinstance(text, str):
                missing = Formula(text).names - known
                _need(not missing, where, f"formula {text!r} reads sizes {sorted(missing)} not listed in sizes")


@dataclass(frozen=True)
class Manifest:
    """All kernels compiled for one architecture."""

    arch: str
    toolchain: Mapping[str, str]
    kernels: Mapping[tuple[str, str], KernelEntry]
    path: Path | None = None
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        ordered = sorted(self.kernels.values(), key=lambda e: (e.family, e.key))
        return {
            "schema": self.schema,
            "arch": self.arch,
            "toolchain": dict(self.toolchain),
            "kernels": [e.to_json() for e in ordered],
        }

    def write(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "manifest", path: Path | None = None) -> Manifest:
        _need(isinstance(d, Mapping), where, "top level must be an object")
        schema = d.get("schema")
        _need(schema == SCHEMA_VERSION, where, f"schema {schema!r} is not {SCHEMA_VERSION}; rebuild the kernels")
        arch = d.get("arch")
        _need(isinstance(arch, str) and arch.startswith("sm_"), where, f"bad arch {arch!r}")
        kernels: dict[tuple[str, str], KernelEntry] = {}
        for i, kd in enumerate(d.get("kernels", [])):
            e = KernelEntry.from_json(kd, f"{where} kernel {i}")
            _need((e.family, e.key) not in kernels, where, f"duplicate kernel {e.name}")
            kernels[(e.family, e.key)] = e
        return cls(arch=arch, toolchain=dict(d.get("toolchain", {})), kernels=kernels, path=path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ManifestError(
                f"no kernel manifest at {path}: run `python build_kernels.py --arch <arch>` first"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_json(data, str(path), path)


def file_sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source_hashes(root: str | os.PathLike[str], rel_paths: Iterable[str]) -> dict[str, str]:
    """sha256 of each source file, keyed by its path relative to `root` (the repository)."""
    root = Path(root)
    return {rel: file_sha256(root / rel) for rel in sorted(set(rel_paths))}


def variant_fingerprint(
    sources: Mapping[str, str],
    config: Mapping[str, Any],
    arch: str,
    toolchain: Mapping[str, str],
    abi_version: int,
) -> str:
    """One hash over everything that determines a cubin and its manifest entry.

    Code-generating options live in `config` (the variant's compile-time parameters), never in
    environment variables, so that a changed option can never reuse a stale cubin.
    """
    blob = json.dumps(
        {
            "sources": dict(sorted(sources.items())),
            "config": config,
            "arch": arch,
            "toolchain": dict(sorted(toolchain.items())),
            "abi": abi_version,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()
