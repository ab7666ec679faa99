"""`GpuVisionTower`: the Qwen3.5 vision tower and merger on the GPU, bf16, torch-free.

The same computation as `vision_reference.VisionTower` (its docstring has the maths), as launches
of AOT-compiled kernels over a tower-owned pair of arenas (weights: every `model.visual.*` tensor
as bf16, in `vision_tensor_shapes` order; workspace: the activations of `max_patches` rows):

    x = the position table blended at each patch's 4 corners         (vision_pos)
    patches --gemm_sm90--> h;  x += h + b                             (vision_bias residual)
    per block:  h = LN1(x);  qkv = h W^T + b;  rotary on q, k          (vision_norm, gemm, vision_rope)
                h = attention per frame group (bidirectional)          (vision_attention)
                x += h W_proj^T + b;  h = LN2(x)
                act = gelu_tanh(h W_fc1^T + b);  x += act W_fc2^T + b
    merger:     h = LN(x) viewed as [N/4, 4W];  act = gelu(h W1^T + b1);  out = act W2^T + b2

Buffers: `x` (the residual stream), `h`, `big` (the qkv rows, then the MLP activation: never both
alive), `out`, the patches and the per-call tables of `vision_plan` (position corners and
weights, rotary tables, group bounds). Every projection is the
prefill GEMM (`gemm_sm90`, any M >= 1; a tower call has at least min_pixels / patch**2 rows, so
the GEMV's M <= 16 never arises).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from runtime.artifact.formats import bf16_to_f32, f32_to_bf16
from runtime.cuda.memory import DeviceArenas
from runtime.model.gpu.kernels import _need
from runtime.model.gpu.vision_plan import VisionPlan, plan_items
from runtime.model.vision_reference import VisionConfig, vision_tensor_shapes


class VisionKernels:
    """The variant keys of the tower's kernels for one `VisionConfig`; a shape nobody compiled is
    an error naming it (`_need`)."""

    def __init__(self, library: Any, c: VisionConfig):
        w, merged = c.hidden_size, c.hidden_size * c.spatial_merge_size ** 2
        self.norm = _need(library, "vision_norm", "the tower's LayerNorm", W=w)
        self.pos = _need(library, "vision_pos", "the tower's position rows", W=w, P=c.num_position_embeddings)
        self.bias = {
            "qkv": _need(library, "vision_bias", "the qkv bias", mode="none", N=3 * w),
            "mlp": _need(library, "vision_bias", "the MLP bias + tanh-GELU", mode="gelu_tanh",
                         N=c.intermediate_size),
            "residual": _need(library, "vision_bias", "the residual bias add", mode="residual", N=w),
            "merge": _need(library, "vision_bias", "the merger bias + GELU", mode="gelu_erf", N=merged),
            "out": _need(library, "vision_bias", "the merger output bias", mode="none", N=c.out_hidden_size)}
        self.rope = _need(library, "vision_rope", "the tower's 2-D rotary", heads=c.num_heads, D=c.head_dim)
        self.attention = _need(library, "vision_attention", "the tower's attention", heads=c.num_heads,
                               D=c.head_dim)
        self.gemm = {(n, k): _need(library, "gemm_sm90", f"a {n}x{k} tower projection", N=n, K=k, ld=n, out="bf16")
                     for n, k in {(w, c.patch_dim), (3 * w, w), (w, w), (c.intermediate_size, w),
                                  (w, c.intermediate_size), (merged, merged), (c.out_hidden_size, merged)}}


class GpuVisionTower:
    """The tower on one device (see the module docstring).

    config / weights: the vision component (canonical names of `vision_tensor_shapes`, any float
    dtype; uploaded as bf16); max_patches: the most patch rows one `encode` call takes (the
    workspace is sized for it once, here). `library`: the kernel library of the device."""

    def __init__(self, config: VisionConfig, weights: Mapping[str, np.ndarray], *, device: Any, library: Any,
                 max_patches: int, stream: Any = None):
        c = self.config = config
        merge2 = c.spatial_merge_size ** 2
        if max_patches < merge2 or max_patches % merge2:
            raise ValueError(f"max_patches must be a positive multiple of {merge2}, got {max_patches}")
        self.device, self.library = device, library
        self.stream = stream or device.create_stream()
        self.kernels = VisionKernels(library, c)
        self.max_patches = max_patches
        shapes = vision_tensor_shapes(c)
        missing = [name for name in shapes if name not in weights]
        if missing:
            raise ValueError(f"vision weights: missing {', '.join(missing[:4])}")
        for name, shape in shapes.items():
            if tuple(np.shape(weights[name])) != shape:
                raise ValueError(f"vision weights: {name} has shape {list(np.shape(weights[name]))}, "
                                 f"expected {list(shape)}")
        n, w = max_patches, c.hidden_size
        act = max(3 * w, c.intermediate_size, w * merge2)
        half = c.head_dim // 2
        sizes = {"patches": n * c.patch_dim * 2, "x": n * w * 2, "h": n * w * 2, "big": n * act * 2,
                 "out": n // merge2 * c.out_hidden_size * 2, "cos": n * half * 4, "sin": n * half * 4,
                 "cu": (n + 1) * 4, "pos_idx": n * 16, "pos_wts": n * 16}
        weight_bytes = sum(int(np.prod(s)) * 2 + 256 for s in shapes.values())
        self.arenas = DeviceArenas.reserve(device, weights=weight_bytes,
                                           workspace=sum(b + 256 for b in sizes.values()))
        self.w = {}
        for name in shapes:
            buf = self.arenas["weights"].take(int(np.prod(shapes[name])) * 2, name)
            device.memcpy_htod(buf.ptr, f32_to_bf16(np.asarray(weights[name], np.float32)), self.stream)
            self.w[name] = buf.ptr
        self.buf = {name: self.arenas["workspace"].take(nbytes, name).ptr for name, nbytes in sizes.items()}
        self.stream.synchronize()

    def encode(self, patches: np.ndarray, grid: Sequence[int]) -> np.ndarray:
        """One image or video, as `VisionTower.encode`: merged embeddings [t*h*w / merge**2,
        out_hidden_size] float32 (bf16 values)."""
        return self.encode_many([patches], [grid])[0]

    def encode_many(self, patches: Sequence[np.ndarray], grids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Items encoded in one pass (each frame attends only within itself)."""
        c = self.config
        plan = plan_items(c, grids)
        if plan.rows > self.max_patches:
            raise ValueError(f"{plan.rows} patches exceed this tower's max_patches {self.max_patches}")
        for item, (grid, rows) in enumerate(zip(grids, patches)):
            t, h, w = (int(v) for v in grid)
            if np.shape(rows) != (t * h * w, c.patch_dim):
                raise ValueError(f"item {item}: patches {list(np.shape(rows))} do not fit grid {t, h, w} "
                                 f"(patch dim {c.patch_dim})")
        self.upload(np.concatenate([np.asarray(p, np.float32) for p in patches]), plan)
        for launch in self.launches(plan):
            launch(self.stream)
        out = np.empty((plan.rows // c.spatial_merge_size ** 2, c.out_hidden_size), np.uint16)
        self.device.memcpy_dtoh(out, self.buf["out"], self.stream)
        self.stream.synchronize()
        merged = bf16_to_f32(out)
        return [merged[a:b] for a, b in plan.merged]

    def upload(self, patches: np.ndarray, plan: VisionPlan) -> None:
        """The call's inputs: patches (bf16), the position corners and weights, the rotary
        tables and the group bounds."""
        d, s, b = self.device, self.stream, self.buf
        d.memcpy_htod(b["patches"], f32_to_bf16(patches), s)
        d.memcpy_htod(b["pos_idx"], plan.pos_idx, s)
        d.memcpy_htod(b["pos_wts"], plan.pos_wts, s)
        d.memcpy_htod(b["cos"], plan.cos, s)
        d.memcpy_htod(b["sin"], plan.sin, s)
        d.memcpy_htod(b["cu"], plan.cu, s)

    def launches(self, plan: VisionPlan) -> list:
        """The tower's bound launches for this plan's row count and groups, in order."""
        c, k, b, wt = self.config, self.kernels, self.buf, self.w
        n, merge2 = plan.rows, c.spatial_merge_size ** 2
        shapes = vision_tensor_shapes(c)
        out: list = []

        def run(family: str, key: str, bufs: dict, sizes: dict) -> None:
            out.append(self.library.kernel(family, key).bind(bufs, sizes))

        def linear(x: int, weight: str, dst: int, rows: int) -> None:
            shape = shapes[weight]
            n_out, k_in = shape[0], int(np.prod(shape[1:]))
            run("gemm_sm90", k.gemm[(n_out, k_in)], {"x": x, "w": wt[weight], "out": dst}, {"M": rows})

        def bias(kind: str, x: int, vec: str, dst: int, rows: int) -> None:
            target = "res" if kind == "residual" else "out"
            run("vision_bias", k.bias[kind], {"x": x, "b": wt[vec], target: dst}, {"M": rows})

        def norm(x: int, prefix: str, dst: int, rows: int) -> None:
            run("vision_norm", k.norm, {"x": x, "w": wt[prefix + ".weight"], "b": wt[prefix + ".bias"],
                                        "out": dst}, {"M": rows})

        run("vision_pos", k.pos, {"table": wt["pos_embed.weight"], "idx": b["pos_idx"], "wts": b["pos_wts"],
                                  "out": b["x"]}, {"M": n})
        linear(b["patches"], "patch_embed.proj.weight", b["h"], n)
        bias("residual", b["h"], "patch_embed.proj.bias", b["x"], n)
        for i in range(c.depth):
            p = f"blocks.{i}."
            norm(b["x"], p + "norm1", b["h"], n)
            linear(b["h"], p + "attn.qkv.weight", b["big"], n)
            bias("qkv", b["big"], p + "attn.qkv.bias", b["big"], n)
            run("vision_rope", k.rope, {"qkv": b["big"], "cos": b["cos"], "sin": b["sin"]}, {"M": n})
            run("vision_attention", k.attention, {"qkv": b["big"], "cu": b["cu"], "out": b["h"]},
                {"M": n, "G": plan.groups, "S": plan.longest})
            linear(b["h"], p + "attn.proj.weight", b["big"], n)
            bias("residual", b["big"], p + "attn.proj.bias", b["x"], n)
            norm(b["x"], p + "norm2", b["h"], n)
            linear(b["h"], p + "mlp.linear_fc1.weight", b["big"], n)
            bias("mlp", b["big"], p + "mlp.linear_fc1.bias", b["big"], n)
            linear(b["big"], p + "mlp.linear_fc2.weight", b["h"], n)
            bias("residual", b["h"], p + "mlp.linear_fc2.bias", b["x"], n)
        # The merger's norm is per patch; its rows of 4 consecutive patches (one merge window)
        # are then read as one row of 4W, which is the same memory.
        norm(b["x"], "merger.norm", b["h"], n)
        linear(b["h"], "merger.linear_fc1.weight", b["big"], n // merge2)
        bias("merge", b["big"], "merger.linear_fc1.bias", b["big"], n // merge2)
        linear(b["big"], "merger.linear_fc2.weight", b["out"], n // merge2)
        bias("out", b["out"], "merger.linear_fc2.bias", b["out"], n // merge2)
        return out

    def close(self) -> None:
        self.arenas.release()


def tower_from_component(component: Any, device: Any, library: Any, stream: Any) -> GpuVisionTower:
    """The tower of an artifact's `vision` component, its workspace sized for the largest image
    its processor config allows (a video is encoded a frame group at a time, which is smaller)."""
    from runtime.media.image import ImageRules
    from runtime.model.weights import ComponentTensors

    config = VisionConfig.from_dict(component.config)
    processor = component.config.get("image_processor") or {}
    max_pixels = int(processor.get("max_pixels") or ImageRules().max_pixels)
    merge2 = config.spatial_merge_size ** 2
    patches = max(max_pixels // config.patch_size ** 2 // merge2, 1) * merge2
    return GpuVisionTower(config, ComponentTensors(component), device=device, library=library,
                          max_patches=patches, stream=stream)
