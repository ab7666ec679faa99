"""A kernel library whose launches run the families' NumPy references on the null device's
memory, so `GpuVisionTower` runs end to end on the CPU: its host side (plans, uploads, buffer
reuse, the launch order) is checked against the NumPy tower with values, not only shapes.

Only the families the tower launches are emulated; their configs come from the families'
`variants()`, so `VisionKernels` finds the same keys it finds in a built manifest.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import numpy as np

from cute_kernels import gemm_sm90, vision_attention, vision_bias, vision_norm, vision_pos, vision_rope
from runtime.artifact.formats import bf16_to_f32, f32_to_bf16

FAMILIES = (gemm_sm90, vision_bias, vision_norm, vision_rope, vision_attention, vision_pos)


class EmulatedLibrary:
    def __init__(self, device: Any):
        self.device = device
        self.root = Path("emulated")
        kernels = {(v.family, v.key): SimpleNamespace(config=dict(v.config)) for mod in FAMILIES
                   for v in mod.variants()}
        self.manifest = SimpleNamespace(arch="sm_90a", kernels=kernels)
        self.launched: list[tuple[str, str]] = []

    def kernel(self, family: str, key: str) -> "EmulatedKernel":
        return EmulatedKernel(self, family, key, self.manifest.kernels[(family, key)].config)


class EmulatedKernel:
    def __init__(self, library: EmulatedLibrary, family: str, key: str, config: Mapping[str, Any]):
        self.library, self.family, self.key, self.config = library, family, key, config

    def bind(self, bufs: Mapping[str, int], sizes: Mapping[str, int]):
        return lambda stream: self.run(dict(bufs), dict(sizes))

    def read(self, ptr: int, shape: tuple[int, ...], dtype: str = "bf16") -> np.ndarray:
        out = np.empty(shape, {"bf16": np.uint16, "f32": np.float32, "i32": np.int32}[dtype])
        self.library.device.memcpy_dtoh(out, ptr)
        return bf16_to_f32(out) if dtype == "bf16" else out

    def write(self, ptr: int, values: np.ndarray) -> None:
        self.library.device.memcpy_htod(ptr, f32_to_bf16(values.astype(np.float32)))

    def run(self, b: dict, s: dict) -> None:
        self.library.launched.append((self.family, self.key))
        c, m = self.config, s["M"]
        if self.family == "gemm_sm90":
            x, w = self.read(b["x"], (m, c["K"])), self.read(b["w"], (c["N"], c["K"]))
            # Row by row: BLAS picks its blocking by the row count, so a whole-matrix product may
            # round a row differently in a batch than alone, which the kernel never does.
            self.write(b["out"], np.concatenate([gemm_sm90.reference(x[r:r + 1], w) for r in range(m)]))
        elif self.family == "vision_bias":
            n = c["N"]
            target = "res" if c["mode"] == "residual" else "out"
            res = self.read(b["res"], (m, n)) if c["mode"] == "residual" else None
            y = vision_bias.reference(self.read(b["x"], (m, n)), self.read(b["b"], (n,)), mode=c["mode"], res=res)
            self.write(b[target], y)
        elif self.family == "vision_norm":
            w = c["W"]
            y = vision_norm.reference(self.read(b["x"], (m, w)), self.read(b["w"], (w,)), self.read(b["b"], (w,)))
            self.write(b["out"], y)
        elif self.family == "vision_pos":
            table = self.read(b["table"], (c["P"], c["W"]))
            idx, wts = self.read(b["idx"], (m, 4), "i32"), self.read(b["wts"], (m, 4), "f32")
            assert idx.min() >= 0 and idx.max() < c["P"]
            self.write(b["out"], vision_pos.reference(table, idx, wts))
        elif self.family == "vision_rope":
            width3, half = 3 * c["heads"] * c["D"], c["D"] // 2
            y = vision_rope.reference(self.read(b["qkv"], (m, width3)), self.read(b["cos"], (m, half), "f32"),
                                      self.read(b["sin"], (m, half), "f32"), heads=c["heads"])
            self.write(b["qkv"], y)
        elif self.family == "vision_attention":
            width = c["heads"] * c["D"]
            cu = self.read(b["cu"], (s["G"] + 1,), "i32")
            assert cu[0] == 0 and cu[-1] <= m and int(np.diff(cu).max()) == s["S"], (cu, s)
            qkv = self.read(b["qkv"], (m, 3 * width))
            y = vision_attention.reference(qkv, cu, heads=c["heads"])
            out = self.read(b["out"], (m, width))
            out[:cu[-1]] = y[:cu[-1]]
            self.write(b["out"], out)
        else:
            raise AssertionError(f"the tower launched {self.family}/{self.key}")
