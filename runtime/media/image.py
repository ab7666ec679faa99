"""Image bytes -> the vision tower's input: decode, smart resize, normalise, patchify.

The rules are those of Qwen's image processor (qwen-arch section 4): both sides resized to
multiples of patch * merge (32 for Qwen3.5) with the pixel count kept in [min_pixels,
max_pixels], bicubic resampling, scale to [0, 1], `(x - mean) / std`, then the image cut into
temporal_patch x patch x patch cubes (a still image repeated in time), listed merge window by
merge window so that each window's merge_size**2 patches are consecutive.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np

from runtime.media.sources import MediaError

MAX_ASPECT_RATIO = 200           # Qwen's processor refuses more extreme shapes
MAX_DECODED_PIXELS = 1 << 26     # 67 MP decoded: beyond it a file is refused (decompression bomb)


@dataclass(frozen=True)
class ImageRules:
    """The model's preprocessing (from the artifact's vision config).

    patch_size / temporal_patch_size / merge_size: the tower's patch cube and merge window.
    min_pixels / max_pixels: the pixel budget of the resized image; `--vision-max-merged N`
        lowers max_pixels to N merged tokens (`capped`).
    mean / std: per-channel normalisation of [0, 1] values.
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def capped(self, max_merged: int | None) -> "ImageRules":
        """These rules with at most `max_merged` merged tokens per image (None: unchanged)."""
        if max_merged is None:
            return self
        cap = max_merged * self.factor * self.factor
        return ImageRules(self.patch_size, self.temporal_patch_size, self.merge_size,
                          min(self.min_pixels, cap), min(self.max_pixels, cap), self.mean,
                          self.std)


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower.

    patches: float32 [grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch], rows in
        merge-window order, each row ordered (channel, time, y, x) like the Conv3d kernel.
    grid: (grid_t, grid_h, grid_w) in patches.
    digest: sha256 of the decoded pixels and the grid (the encoder cache and prefix-cache key).
    """

    patches: np.ndarray
    grid: tuple[int, int, int]
    digest: str

    def merged_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid
        return t * (h // merge_size) * (w // merge_size)


def decode_image(data: bytes, where: str) -> np.ndarray:
    """Encoded bytes -> uint8 RGB [H, W, 3]. Alpha is dropped, not composited (seed 002)."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError(where, "the file holds no image")
            stream = container.streams.video[0]
            if stream.codec_context.width * stream.codec_context.height > MAX_DECODED_PIXELS:
                raise MediaError(where, f"the image is larger than {MAX_DECODED_PIXELS} pixels")
            frame = next(container.decode(stream), None)
            if frame is None:
                raise MediaError(where, "the image could not be decoded (no frame)")
            if frame.width * frame.height > MAX_DECODED_PIXELS:
                raise MediaError(where, f"the image is larger than {MAX_DECODED_PIXELS} pixels")
            return frame.to_ndarray(format="rgb24")
    except MediaError:
        raise
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, StopIteration) as exc:
        raise MediaError(where, f"not a decodable image ({type(exc).__name__}: {exc})") \
            from None


def smart_resize(height: int, width: int, rules: ImageRules, where: str = "image"
                 ) -> tuple[int, int]:
    """Target (height, width): multiples of `rules.factor`, pixels within the budget, aspect
    ratio kept as closely as the rounding allows."""
    factor = rules.factor
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(where, f"aspect ratio {max(height, width) / min(height, width):.0f} "
                                f"is over {MAX_ASPECT_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > rules.max_pixels:
        beta = math.sqrt(height * width / rules.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < rules.min_pixels:
        beta = math.sqrt(rules.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' bicubic kernel with a = -0.5 (the one Pillow's BICUBIC uses)."""
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _resample_weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Source indices and weights [size_out, taps] of one axis. Downscaling widens the kernel
    by the scale (antialiasing, as Pillow does), so every source pixel contributes."""
    scale = size_in / size_out
    support = 2.0 * max(scale, 1.0)
    centres = (np.arange(size_out) + 0.5) * scale
    first = np.floor(centres - support).astype(np.int64)
    taps = int(math.ceil(2 * support)) + 2
    index = first[:, None] + np.arange(taps)[None, :]
    weights = _cubic((index + 0.5 - centres[:, None]) / max(scale, 1.0))
    weights[(index < 0) | (index >= size_in)] = 0.0
    weights /= weights.sum(axis=1, keepdims=True)
    return np.clip(index, 0, size_in - 1), weights


def resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] -> float64 [height, width, 3] in 0..255, bicubic, rows then columns."""
    image = pixels.astype(np.float64)
    if image.shape[0] != height:
        index, weights = _resample_weights(image.shape[0], height)
        image = np.einsum("ok,okwc->owc", weights, image[index])
    if image.shape[1] != width:
        index, weights = _resample_weights(image.shape[1], width)
        image = np.einsum("ok,hokc->hoc", weights, image[:, index])
    return image


def prepare_image(pixels: np.ndarray, rules: ImageRules, where: str = "image") -> PreparedImage:
    """Decoded RGB uint8 [H, W, 3] -> the tower's patches (see `PreparedImage`)."""
    height, width = smart_resize(pixels.shape[0], pixels.shape[1], rules, where)
    # Resampled values are rounded to uint8 like an 8-bit image resize, then normalised.
    resized = np.clip(np.round(resize(pixels, height, width)), 0, 255)
    mean = np.asarray(rules.mean, np.float64)
    std = np.asarray(rules.std, np.float64)
    image = ((resized / 255.0 - mean) / std).astype(np.float32).transpose(2, 0, 1)  # [3, H, W]
    p, tp, m = rules.patch_size, rules.temporal_patch_size, rules.merge_size
    gh, gw = height // p, width // p
    frames = np.broadcast_to(image[None], (tp, *image.shape))                 # [tp, 3, H, W]
    cubes = frames.reshape(tp, 3, gh // m, m, p, gw // m, m, p)
    # -> [gh/m, gw/m, m, m, 3, tp, p, p]: merge window, position in it, then the Conv3d order.
    cubes = cubes.transpose(2, 5, 3, 6, 1, 0, 4, 7)
    patches = np.ascontiguousarray(cubes.reshape(gh * gw, 3 * tp * p * p))
    digest = hashlib.sha256(pixels.tobytes() + f"{pixels.shape}{(1, gh, gw)}".encode()).hexdigest()
    return PreparedImage(patches=patches, grid=(1, gh, gw), digest=digest)
