"""The Qwen3.5 vision tower and merger in NumPy (qwen-arch section 4): exact, float32 or float64.

    patches [N, 3*tp*p*p] --patch embedding (the Conv3d as one matmul)--> [N, width]
      + learned position embedding, bilinearly resampled (align_corners) to each image's grid
      -> depth x pre-LayerNorm blocks: bidirectional attention within each image/frame with 2-D
         rotary (row frequencies | column frequencies over the whole head), tanh-GELU MLP
      -> merger: LayerNorm, each merge window's 4 tokens as one row, fc1, exact GELU, fc2
      -> [N / merge**2, out_hidden_size] rows that replace the prompt's pad embeddings in order.

Patches arrive in merge-window order (`runtime.media.image`), so a window's tokens are
consecutive and the merger is a reshape. Tensor names are the checkpoint's `model.visual.*`
without the prefix (`vision_tensor_shapes`, shared by the converter and the tiny-model tool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from runtime.model.config import ModelConfigError as ConfigError


@dataclass(frozen=True)
class VisionConfig:
    """The tower's shape (HF `vision_config`) and the token ids the prompt uses for media."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int | None = None      # artifacts converted before video support lack it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "VisionConfig":
        def need(key: str, default: Any = None) -> Any:
            value = config.get(key, default)
            if value is None:
                raise ConfigError(f"vision config: missing {key!r}")
            return value
        if need("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ConfigError(f"vision config: hidden_act {config['hidden_act']!r} is not "
                              "supported (Qwen3.5's tower uses gelu_pytorch_tanh)")
        if config.get("deepstack_visual_indexes"):
            raise ConfigError("vision config: deepstack layers (Qwen3-VL) are not supported; "
                              "Qwen3.5 has none")
        rope = config.get("rope_parameters") or {}
        made = cls(depth=int(need("depth")), hidden_size=int(need("hidden_size")),
                   num_heads=int(need("num_heads")),
                   intermediate_size=int(need("intermediate_size")),
                   out_hidden_size=int(need("out_hidden_size")),
                   patch_size=int(need("patch_size", 16)),
                   temporal_patch_size=int(need("temporal_patch_size", 2)),
                   spatial_merge_size=int(need("spatial_merge_size", 2)),
                   num_position_embeddings=int(need("num_position_embeddings")),
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   image_token_id=int(need("image_token_id")),
                   vision_start_token_id=int(need("vision_start_token_id")),
                   vision_end_token_id=int(need("vision_end_token_id")),
                   video_token_id=(int(config["video_token_id"])
                                   if config.get("video_token_id") is not None else None))
        side = math.isqrt(made.num_position_embeddings)
        if side * side != made.num_position_embeddings:
            raise ConfigError("vision config: num_position_embeddings must be a square")
        if made.hidden_size % made.num_heads or made.head_dim % 4:
            raise ConfigError("vision config: head dim must divide by 4 (2-D rotary halves)")
        return made


def vision_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes of the vision component."""
    w, merged = c.hidden_size, c.hidden_size * c.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (w, 3, c.temporal_patch_size, c.patch_size,
                                          c.patch_size),
              "patch_embed.proj.bias": (w,), "pos_embed.weight": (c.num_position_embeddings, w)}
    for i in range(c.depth):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (w,), b + "norm1.bias": (w,),
                       b + "norm2.weight": (w,), b + "norm2.bias": (w,),
                       b + "attn.qkv.weight": (3 * w, w), b + "attn.qkv.bias": (3 * w,),
                       b + "attn.proj.weight": (w, w), b + "attn.proj.bias": (w,),
                       b + "mlp.linear_fc1.weight": (c.intermediate_size, w),
                       b + "mlp.linear_fc1.bias": (c.intermediate_size,),
                       b + "mlp.linear_fc2.weight": (w, c.intermediate_size),
                       b + "mlp.linear_fc2.bias": (w,)})
    shapes.update({"merger.norm.weight": (w,), "merger.norm.bias": (w,),
                   "merger.linear_fc1.weight": (merged, merged),
                   "merger.linear_fc1.bias": (merged,),
                   "merger.linear_fc2.weight": (c.out_hidden_size, merged),
                   "merger.linear_fc2.bias": (c.out_hidden_size,)})
    return shapes


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-6
               ) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_exact(x: np.ndarray) -> np.ndarray:
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[x.dtype])(x / math.sqrt(2.0)))


def window_order_rows_cols(grid_h: int, grid_w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one frame, listed in merge-window order."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def bilinear_axis(coord: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Along one axis, patch coordinates `coord` of a grid of `size` mapped onto a table of `side`
    with align_corners: (lower table index, upper index, fraction towards the upper)."""
    x = coord * ((side - 1) / (size - 1)) if size > 1 else np.zeros(len(coord))
    low = np.floor(x).astype(np.int64)
    return low, np.minimum(low + 1, side - 1), x - low


def resampled_positions(table: np.ndarray, rows: np.ndarray, cols: np.ndarray, grid_h: int,
                        grid_w: int) -> np.ndarray:
    """The square learned table [side*side, W] resampled bilinearly with align_corners to a
    grid_h x grid_w grid, at the given patch coordinates."""
    side = math.isqrt(table.shape[0])
    r0, r1, fr = bilinear_axis(rows, grid_h, side)
    c0, c1, fc = bilinear_axis(cols, grid_w, side)
    frac_r, frac_c = fr[:, None].astype(table.dtype), fc[:, None].astype(table.dtype)
    return ((1 - frac_r) * (1 - frac_c) * table[r0 * side + c0]
            + (1 - frac_r) * frac_c * table[r0 * side + c1]
            + frac_r * (1 - frac_c) * table[r1 * side + c0]
            + frac_r * frac_c * table[r1 * side + c1])


class VisionTower:
    """The tower over one artifact's vision tensors, in `dtype` (see the module docstring)."""

    def __init__(self, config: VisionConfig, weights: Mapping[str, np.ndarray],
                 dtype: Any = np.float32):
        self.config = config
        self.dtype = np.dtype(dtype)
        shapes = vision_tensor_shapes(config)
        missing = [name for name in shapes if name not in weights]
        if missing:
            raise ConfigError(f"vision weights: missing {', '.join(missing[:4])}")
        self.w = {}
        for name, shape in shapes.items():
            value = np.asarray(weights[name], dtype=self.dtype)
            if value.shape != shape:
                raise ConfigError(f"vision weights: {name} has shape {list(value.shape)}, "
                                  f"expected {list(shape)}")
            self.w[name] = value
        # The Conv3d with stride = kernel is a matmul over the flattened (c, t, y, x) cube.
        self.patch_weight_t = self.w["patch_embed.proj.weight"].reshape(config.hidden_size, -1).T

    def encode(self, patches: np.ndarray, grid: Sequence[int]) -> np.ndarray:
        """One image or video: patches [t*h*w, patch_dim] (merge-window order per frame) ->
        merged embeddings [t*h*w / merge**2, out_hidden_size]."""
        c = self.config
        t, h, w = (int(v) for v in grid)
        m = c.spatial_merge_size
        if h % m or w % m or patches.shape != (t * h * w, c.patch_dim):
            raise ValueError(f"patches {list(patches.shape)} do not fit grid {t, h, w} "
                             f"(patch dim {c.patch_dim}, merge {m})")
        x = np.asarray(patches, self.dtype) @ self.patch_weight_t + self.w["patch_embed.proj.bias"]
        rows, cols = window_order_rows_cols(h, w, m)
        x = x + np.tile(resampled_positions(self.w["pos_embed.weight"], rows, cols, h, w), (t, 1))
        cos, sin = self._rotary(rows, cols)
        frames = x.reshape(t, h * w, c.hidden_size)
        for i in range(c.depth):
            frames = self._block(f"blocks.{i}.", frames, cos, sin)
        x = layer_norm(frames.reshape(-1, c.hidden_size), self.w["merger.norm.weight"],
                       self.w["merger.norm.bias"]).reshape(-1, c.hidden_size * m * m)
        x = gelu_exact(x @ self.w["merger.linear_fc1.weight"].T + self.w["merger.linear_fc1.bias"])
        return x @ self.w["merger.linear_fc2.weight"].T + self.w["merger.linear_fc2.bias"]

    def _rotary(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [h*w, head_dim]: head_dim/4 frequencies of the row, then of the column,
        the pair repeated so rotate-half covers the whole head (computed in float64)."""
        quarter = self.config.head_dim // 2
        inv_freq = self.config.rope_theta ** (-np.arange(0, quarter, 2, dtype=np.float64) / quarter)
        angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
        angles = np.concatenate([angles, angles], axis=-1)
        return np.cos(angles).astype(self.dtype), np.sin(angles).astype(self.dtype)

    def _block(self, b: str, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [frames, tokens, W]: attention never crosses a frame (each is its own sequence)."""
        c, w = self.config, self.w
        frames, tokens, _ = x.shape
        h = layer_norm(x, w[b + "norm1.weight"], w[b + "norm1.bias"])
        qkv = (h @ w[b + "attn.qkv.weight"].T + w[b + "attn.qkv.bias"]).reshape(
            frames, tokens, 3, c.num_heads, c.head_dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))    # [F, heads, N, d]
        half = c.head_dim // 2

        def rotate(y: np.ndarray) -> np.ndarray:
            turned = np.concatenate([-y[..., half:], y[..., :half]], axis=-1)
            return y * cos + turned * sin

        q, k = rotate(q), rotate(k)
        scores = (q @ k.transpose(0, 1, 3, 2)) * (c.head_dim ** -0.5)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attended = (scores / scores.sum(axis=-1, keepdims=True)) @ v          # [F, heads, N, d]
        attended = attended.transpose(0, 2, 1, 3).reshape(frames, tokens, c.hidden_size)
        x = x + attended @ w[b + "attn.proj.weight"].T + w[b + "attn.proj.bias"]
        h = layer_norm(x, w[b + "norm2.weight"], w[b + "norm2.bias"])
        h = gelu_tanh(h @ w[b + "mlp.linear_fc1.weight"].T + w[b + "mlp.linear_fc1.bias"])
        return x + h @ w[b + "mlp.linear_fc2.weight"].T + w[b + "mlp.linear_fc2.bias"]


ENCODER_CACHE_ITEMS = 64
"""Encoded images and video frame groups kept by digest (a video is many groups): a prompt's
chunks and a preempted sequence's replay reuse them."""


class MediaEmbedder:
    """A runner's tower plus its encoder cache: puts merged embeddings at the pad positions."""

    def __init__(self, tower: VisionTower):
        self.tower = tower
        self._encoded: dict[str, np.ndarray] = {}       # digest -> embeddings, oldest first

    def place(self, x: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
              media: Sequence[Sequence[Any]]) -> np.ndarray:
        """x [B, T, H] embeddings of tokens [B, T] at KV positions [B, T]; media[b]: row b's
        `MediaSpan`s. Each pad inside a block takes the block's embedding of that position."""
        from runtime.model.mrope import span_layout

        merge = self.tower.config.spatial_merge_size
        pads = [self.tower.config.image_token_id, self.tower.config.video_token_id]
        x = x.copy()
        for b, spans in enumerate(media):
            for span in spans:
                count = span_layout(span, merge)[0]
                inside = (positions[b] >= span.offset) & (positions[b] < span.offset + count)
                if not inside.any():
                    continue
                if not np.all(np.isin(tokens[b][inside], pads)):
                    raise ValueError(f"the media block at {span.offset} covers tokens that are "
                                     "not image or video pads")
                x[b, inside] = self.encode(span)[positions[b][inside] - span.offset]
        return x

    def encode(self, span: Any) -> np.ndarray:
        """The block's merged embeddings, from the cache when its digest was seen."""
        if span.digest and span.digest in self._encoded:
            return self._encoded[span.digest]
        encoded = self.tower.encode(span.patches, span.grid)
        if span.digest:
            if len(self._encoded) >= ENCODER_CACHE_ITEMS:
                del self._encoded[next(iter(self._encoded))]
            self._encoded[span.digest] = encoded
        return encoded
