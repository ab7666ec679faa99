"""Encoded tensors and the exact repacking the converter does with them.

An `Encoded` is a tensor in one of the artifact formats, held as its stored parts (see
`spec.part_specs`). Stacking experts, fusing gate|up rows and permuting rows (Qwen3-Next's
grouped projections) work on the encoded parts whenever the format allows it, so imported
quantised weights stay bit-exact; otherwise they fall back to decoding into fp32 (the caller
then re-encodes, with rounding, into its target format).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.artifact import formats, spec


@dataclass
class Encoded:
    fmt: str
    shape: tuple[int, ...]
    parts: dict[str, np.ndarray]
    row_groups: int = 1

    @staticmethod
    def from_f32(values: np.ndarray, fmt: str = "fp32", row_groups: int = 1) -> "Encoded":
        values = np.asarray(values, dtype=np.float32)
        if fmt not in spec.QUANTIZED:
            row_groups = 1
        return Encoded(fmt, values.shape, spec.encode(values, fmt, row_groups), row_groups)

    def f32(self) -> np.ndarray:
        return spec.decode(self.parts, self.fmt, self.row_groups)

    @property
    def quantized(self) -> bool:
        return self.fmt in spec.QUANTIZED


def to_format(item: Encoded, fmt: str, row_groups: int = 1) -> Encoded:
    """`item` in format `fmt`; unchanged (bit-exact) when it already is in that layout."""
    if fmt not in spec.QUANTIZED:
        row_groups = 1
    if item.fmt == fmt and item.row_groups == row_groups:
        return item
    return Encoded.from_f32(item.f32(), fmt, row_groups)


def reshape(item: Encoded, shape: tuple[int, ...]) -> Encoded:
    """Reshape a plain (bf16/fp32) tensor; quantised ones are decoded first."""
    if item.quantized:
        item = Encoded.from_f32(item.f32())
    return Encoded(item.fmt, tuple(shape), {"data": item.parts["data"].reshape(shape)})


def _same_plain_or_quantized(items: list[Encoded]) -> bool:
    first = items[0]
    return all(i.fmt == first.fmt and i.shape[-1] == first.shape[-1] for i in items)


def stack(items: list[Encoded]) -> Encoded:
    """Stack equal-shaped tensors along a new leading axis (per-expert -> fused experts)."""
    first = items[0]
    if _same_plain_or_quantized(items) and all(i.shape == first.shape and
                                               i.row_groups == first.row_groups for i in items):
        parts = {key: np.stack([i.parts[key] for i in items]) for key in first.parts}
        return Encoded(first.fmt, (len(items),) + first.shape, parts, first.row_groups)
    return Encoded.from_f32(np.stack([i.f32() for i in items]))


def concat_rows(items: list[Encoded]) -> Encoded:
    """Concatenate along the row axis (-2), e.g. gate then up. Each quantised piece keeps its
    own scales: the result has the pieces' row groups added up, which is exact as long as all
    pieces have equally sized row groups."""
    first = items[0]
    group_rows = {i.shape[-2] // i.row_groups for i in items}
    if _same_plain_or_quantized(items) and all(i.shape[:-2] == first.shape[:-2] for i in items) \
            and (not first.quantized or len(group_rows) == 1):
        axis_of = {"data": -2, "scale": -2, "global_scale": -1}
        parts = {key: np.concatenate([i.parts[key] for i in items], axis=axis_of[key])
                 for key in first.parts}
        rows = sum(i.shape[-2] for i in items)
        groups = sum(i.row_groups for i in items) if first.quantized else 1
        return Encoded(first.fmt, first.shape[:-2] + (rows,) + first.shape[-1:], parts, groups)
    return Encoded.from_f32(np.concatenate([i.f32() for i in items], axis=-2))


def take_rows(item: Encoded, rows: np.ndarray) -> Encoded:
    """Rows `rows` (in that order) of a matrix. nvfp4 scales are per row, so any permutation is
    exact; fp8 scales cover 128 rows, so only whole aligned blocks can move exactly."""
    rows = np.asarray(rows, dtype=np.int64)
    n, k = item.shape[-2], item.shape[-1]
    shape = item.shape[:-2] + (len(rows),) + (k,)
    if item.fmt in ("bf16", "fp32"):
        return Encoded(item.fmt, shape, {"data": item.parts["data"][..., rows, :]})
    if item.fmt == "nvfp4" and item.row_groups == 1:
        parts = {"data": item.parts["data"][..., rows, :], "scale": item.parts["scale"][..., rows, :],
                 "global_scale": item.parts["global_scale"]}
        return Encoded("nvfp4", shape, parts, 1)
    block = formats.FP8_BLOCK
    if item.fmt == "fp8_e4m3" and item.row_groups == 1 and n % block == 0 and len(rows) % block == 0:
        starts = rows[::block]
        aligned = (starts % block == 0) & np.all(
            rows.reshape(-1, block) == starts[:, None] + np.arange(block), axis=1)
        if aligned.all():
            parts = {"data": item.parts["data"][..., rows, :],
                     "scale": item.parts["scale"][..., starts // block, :]}
            return Encoded("fp8_e4m3", shape, parts, 1)
    return Encoded.from_f32(item.f32()[..., rows, :])
