"""The `.infernix` container format: constants, the binary header, tensor formats and the shapes
of their stored parts (docs/artifact.md is the normative description; keep the two in step).

A tensor is stored as one or more *parts* (plain arrays in the payload): `data` for every format,
plus `scale` for fp8_e4m3 and `scale` + `global_scale` for nvfp4. Part dtypes and shapes follow
from (format, logical shape, row_groups) alone, so the reader can check every directory entry
without touching the payload.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from runtime.artifact import formats

MAGIC = b"INFERNIX"
VERSION = 1
# magic, version, shard index, shard count, JSON crc32, JSON bytes, payload offset, payload bytes,
# artifact id (random, shared by all shards of one artifact)
HEADER = struct.Struct("<8sIIIIQQQ16s")
HEADER_BYTES = HEADER.size          # 64
PAYLOAD_ALIGN = 4096                # payload start: page aligned, so mmap views are page aligned
TENSOR_ALIGN = 256                  # every part: enough for TMA and 128-bit vector loads
CRC_WIDTH = 8                       # crc32 as 8 hex digits: fixed width keeps the JSON length
                                    # stable between the placeholder and the final directory

FORMATS = ("bf16", "fp32", "fp8_e4m3", "nvfp4")
QUANTIZED = ("fp8_e4m3", "nvfp4")
COMPONENTS_KNOWN = ("text", "mtp", "vision")   # others (drafters) are allowed by name


class ArtifactError(Exception):
    """A `.infernix` file cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Header:
    version: int
    shard_index: int
    shard_count: int
    json_crc32: int
    json_bytes: int
    payload_offset: int
    payload_bytes: int
    artifact_id: bytes

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.version, self.shard_index, self.shard_count,
                           self.json_crc32, self.json_bytes, self.payload_offset,
                           self.payload_bytes, self.artifact_id)

    @staticmethod
    def unpack(raw: bytes, where: str) -> "Header":
        if len(raw) < HEADER_BYTES:
            raise ArtifactError(f"{where}: truncated: {len(raw)} bytes, shorter than the "
                                f"{HEADER_BYTES}-byte header")
        magic, *fields = HEADER.unpack(raw[:HEADER_BYTES])
        if magic != MAGIC:
            raise ArtifactError(f"{where}: not an .infernix file (magic {magic!r}, "
                                f"expected {MAGIC!r}); an interrupted write leaves no magic")
        header = Header(*fields)
        if header.version != VERSION:
            raise ArtifactError(f"{where}: unsupported format version {header.version} "
                                f"(this reader supports version {VERSION})")
        return header


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class PartSpec:
    """One stored array of a tensor: its name within the tensor, NumPy dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]


# np.dtype.name is slow enough to show in the open time of a large directory.
DTYPE_NAMES = {np.dtype(t): name for t, name in ((np.uint8, "uint8"), (np.uint16, "uint16"),
                                                  (np.float32, "float32"))}


def part_specs(fmt: str, shape: tuple[int, ...], row_groups: int = 1) -> tuple[PartSpec, ...]:
    """The parts a tensor of this format and logical shape is stored as. Raises ValueError
    for a combination the format cannot hold (the caller adds the tensor name)."""
    shape = tuple(int(d) for d in shape)
    if fmt == "bf16":
        return (PartSpec("data", np.dtype(np.uint16), shape),)
    if fmt == "fp32":
        return (PartSpec("data", np.dtype(np.float32), shape),)
    if fmt not in QUANTIZED:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if len(shape) < 2:
        raise ValueError(f"{fmt} needs a matrix or a stack of matrices, got shape {list(shape)}")
    *lead, n, k = shape
    if row_groups < 1 or n % row_groups:
        raise ValueError(f"{n} rows do not split into {row_groups} row groups")
    lead = tuple(lead)
    if fmt == "fp8_e4m3":
        block_rows = row_groups * -(-(n // row_groups) // formats.FP8_BLOCK)
        return (PartSpec("data", np.dtype(np.uint8), shape),
                PartSpec("scale", np.dtype(np.float32),
                         lead + (block_rows, -(-k // formats.FP8_BLOCK))))
    if k % formats.NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs the last dimension to be a multiple of "
                         f"{formats.NVFP4_BLOCK}, got {k}")
    return (PartSpec("data", np.dtype(np.uint8), lead + (n, k // 2)),
            PartSpec("scale", np.dtype(np.uint8), lead + (n, k // formats.NVFP4_BLOCK)),
            PartSpec("global_scale", np.dtype(np.float32), lead + (row_groups,)))


def encode(values: np.ndarray, fmt: str, row_groups: int = 1) -> dict[str, np.ndarray]:
    """Real numbers -> the stored parts of `fmt` (rounding/quantising as the format needs)."""
    if fmt == "bf16":
        return {"data": formats.f32_to_bf16(values)}
    if fmt == "fp32":
        return {"data": np.ascontiguousarray(values, dtype=np.float32)}
    if fmt == "fp8_e4m3":
        codes, scales = formats.fp8_block_quantize(values, row_groups)
        return {"data": codes, "scale": scales}
    if fmt == "nvfp4":
        codes, scales, global_scale = formats.nvfp4_quantize(values, row_groups)
        return {"data": codes, "scale": scales, "global_scale": global_scale}
    raise ValueError(f"unknown format {fmt!r}")


def decode(parts: dict[str, np.ndarray], fmt: str, row_groups: int = 1) -> np.ndarray:
    """Stored parts -> new float32 array of the logical shape."""
    if fmt == "bf16":
        return formats.bf16_to_f32(parts["data"])
    if fmt == "fp32":
        return np.array(parts["data"], dtype=np.float32)
    if fmt == "fp8_e4m3":
        return formats.fp8_block_dequantize(parts["data"], parts["scale"], row_groups)
    if fmt == "nvfp4":
        return formats.nvfp4_dequantize(parts["data"], parts["scale"], parts["global_scale"],
                                        row_groups)
    raise ValueError(f"unknown format {fmt!r}")
