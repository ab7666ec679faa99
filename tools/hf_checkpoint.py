"""A Hugging Face model directory as `tools.convert` reads it: config.json and the safetensors
weights (one file, several, or sharded through `model.safetensors.index.json`), read without torch.

Each tensor is described by what is on disk: BF16 / F32 / F16, Qwen's block FP8 (`weight_scale_inv`)
or NVFP4 (ModelOpt's `weight_scale_2`, compressed-tensors' `weight_packed` + `weight_global_scale`),
as a `Source` that loads it as an `Encoded` in the artifact's format only when asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from runtime.artifact import formats
from runtime.artifact.encoded import Encoded

ST_DTYPES = {"BF16": np.uint16, "F8_E4M3": np.uint8, "U8": np.uint8, "F32": np.float32,
             "F16": np.float16, "I32": np.int32, "I64": np.int64}


class ConvertError(Exception):
    """The checkpoint cannot be converted; the message names the tensor or file."""


class SafetensorsFile:
    """One .safetensors file: its header, and raw tensor bytes read on demand (pread, so memory
    is released as soon as the caller drops the array). NumPy has no bf16/fp8 dtype, so the
    safetensors numpy API cannot return those tensors; we use it to validate the file and read
    the (documented) header ourselves for the byte offsets."""

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open
        self.path = path
        try:
            with safe_open(str(path), framework="np"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ConvertError(f"{path}: not a readable safetensors file: {exc}") from None
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        self.data_start = 8 + size
        header.pop("__metadata__", None)
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {
            name: (info["dtype"], tuple(info["shape"]), *info["data_offsets"])
            for name, info in header.items()}

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self.tensors[name]
        if dtype not in ST_DTYPES:
            raise ConvertError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        with open(self.path, "rb") as handle:
            handle.seek(self.data_start + begin)
            raw = handle.read(end - begin)
        return np.frombuffer(raw, dtype=ST_DTYPES[dtype]).reshape(shape)


@dataclass
class Source:
    """A checkpoint tensor as the converter sees it: the artifact format it is in (exactly),
    its logical shape, the checkpoint tensors it reads and how to load it."""

    fmt: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    load: Callable[[], Encoded]
    kind: str


class Checkpoint:
    """A Hugging Face model directory: config.json plus safetensors weights."""

    def __init__(self, directory: Path):
        self.dir = directory
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ConvertError(f"{directory}: no config.json (not a Hugging Face model directory)")
        self.config = json.loads(config_path.read_text())
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{directory}: no *.safetensors files")
        self.where: dict[str, SafetensorsFile] = {}
        for filename in files:
            if not (directory / filename).is_file():
                raise ConvertError(f"{index}: lists {filename}, which does not exist")
            st = SafetensorsFile(directory / filename)
            for name in st.tensors:
                self.where[name] = st
        self.used: set[str] = set()

    def dtype(self, name: str) -> str:
        return self.where[name].tensors[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].tensors[name][1]

    def read(self, name: str) -> np.ndarray:
        return self.where[name].read(name)

    def _scale_shape_error(self, name: str, got, want) -> ConvertError:
        return ConvertError(f"{name}: scale shape {list(got)}, expected {list(want)}")

    def source(self, name: str) -> Optional[Source]:
        """Detect the tensor's encoding from what is on disk (dtypes and scale siblings)."""
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if name not in self.where:
            packed = f"{module}.weight_packed"
            if module and packed in self.where:
                return self._nvfp4(name, packed, f"{module}.weight_scale",
                                   f"{module}.weight_global_scale", divisor=True)
            return None
        dtype, shape = self.dtype(name), self.shape(name)
        if dtype in ("BF16", "F32"):
            fmt = "bf16" if dtype == "BF16" else "fp32"
            return Source(fmt, shape, (name,), lambda: Encoded(fmt, shape, {"data": self.read(name)}),
                          fmt)
        if dtype == "F16":     # not a Qwen release format; rounded to bf16 below
            return Source("bf16", shape, (name,),
                          lambda: Encoded.from_f32(self.read(name).astype(np.float32)), "f16")
        if dtype == "U8" and module and f"{module}.weight_scale" in self.where:
            return self._nvfp4(name, name, f"{module}.weight_scale", f"{module}.weight_scale_2",
                               divisor=False)
        if dtype == "F8_E4M3" and module:
            for scale in (f"{module}.weight_scale_inv", f"{module}.weight_scale"):
                if scale in self.where:
                    return self._fp8(name, scale)
        raise ConvertError(f"{name}: unsupported encoding (dtype {dtype} without the scale "
                           "tensors of a known quantisation format)")

    def _nvfp4(self, name, codes, scale, global_scale, divisor) -> Source:
        """ModelOpt (global multiplier `weight_scale_2`) or compressed-tensors (global divisor
        `weight_global_scale`); codes and block scales are the same layout as ours."""
        if global_scale not in self.where or self.dtype(scale) != "F8_E4M3":
            raise ConvertError(f"{name}: unsupported encoding (packed 4-bit weight without an "
                               f"F8_E4M3 {scale} and an F32 {global_scale})")
        n, half_k = self.shape(codes)
        shape = (n, 2 * half_k)
        if self.shape(scale) != (n, half_k // 8):
            raise self._scale_shape_error(scale, self.shape(scale), (n, half_k // 8))

        def load() -> Encoded:
            g = self.read(global_scale).astype(np.float32).reshape(1)
            g = (np.float32(1.0) / g).astype(np.float32) if divisor else g.copy()
            return Encoded("nvfp4", shape, {"data": self.read(codes), "scale": self.read(scale),
                                            "global_scale": g})
        kind = "nvfp4 (compressed-tensors)" if divisor else "nvfp4 (ModelOpt)"
        return Source("nvfp4", shape, (codes, scale, global_scale), load, kind)

    def _fp8(self, name, scale) -> Source:
        """Block FP8 (Qwen: `weight_scale_inv`, a multiplier despite its name; bf16 or fp32).
        A per-tensor scale is expanded to blocks exactly; a per-channel scale is decoded."""
        shape = self.shape(name)
        n, k = shape
        grid = (-(-n // formats.FP8_BLOCK), -(-k // formats.FP8_BLOCK))
        scale_shape = self.shape(scale)

        def scales() -> np.ndarray:
            s = self.read(scale)
            return formats.bf16_to_f32(s) if self.dtype(scale) == "BF16" else s.astype(np.float32)

        if scale_shape == grid or int(np.prod(scale_shape)) == 1:
            def load() -> Encoded:
                s = np.broadcast_to(scales().reshape(-1, grid[1]) if scale_shape == grid
                                    else scales().reshape(1, 1), grid)
                return Encoded("fp8_e4m3", shape, {"data": self.read(name),
                                                   "scale": np.ascontiguousarray(s)})
            return Source("fp8_e4m3", shape, (name, scale), load, "fp8 (128x128 blocks)")
        if scale_shape in ((n, 1), (n,)):
            def load() -> Encoded:
                return Encoded.from_f32(formats.e4m3_to_f32(self.read(name))
                                        * scales().reshape(n, 1))
            return Source("fp8_e4m3", shape, (name, scale), load, "fp8 (per channel, decoded)")
        raise self._scale_shape_error(scale, scale_shape, grid)

    def require(self, name: str, shape: tuple[int, ...]) -> Source:
        src = self.source(name)
        if src is None:
            raise ConvertError(f"missing tensor {name} in {self.dir}")
        if tuple(src.shape) != tuple(shape):
            raise ConvertError(f"{name}: shape {list(src.shape)}, expected {list(shape)} "
                               "from config.json")
        self.used.update(src.names)
        return src
