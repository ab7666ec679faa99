"""Video bytes -> the vision tower's input: decode with `av`, sample frames, resize, patchify.

The rules are those of Qwen's video processor (qwen-arch section 4):
- frames: `fps` per second of video (2 for Qwen3.5), at least `min_frames` and at most
  `max_frames` and the video's own count, picked evenly: indices `linspace(0, total - 1, n)`
  rounded (half to even, as numpy rounds);
- size: one (height, width) for the whole clip, multiples of patch * merge, with the pixel
  budget counted over all frames (`frames * height * width` within [min_pixels, max_pixels]);
- time: an odd frame count is padded by repeating the last frame, then each pair of frames
  (temporal patch 2) is one frame group of the tower's grid;
- prompt: the template's `<|vision_start|><|video_pad|><|vision_end|>` keeps its outer markers
  and its pad becomes one block per group, `<{t:.1f} seconds><|vision_start|>` + pads +
  `<|vision_end|>`, t the mean timestamp of the group's two frames (what transformers' processor
  writes: it replaces the pad only); the tower and the MRoPE positions treat each group as a
  one-frame image (attention never crosses a frame).
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, replace

import numpy as np

from runtime.media.image import MAX_ASPECT_RATIO, MAX_DECODED_PIXELS, resize
from runtime.media.sources import MediaError

DEFAULT_FPS = 24.0          # a stream that states no rate: the reference assumes 24
VIDEO_BLOCK = ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
MAX_SAMPLED_BYTES = 1 << 31  # the sampled frames are kept decoded (RGB) until resized: 2 GiB


@dataclass(frozen=True)
class VideoRules:
    """The model's video preprocessing (the artifact's `video_processor` config).

    fps / min_frames / max_frames: the frame sampling rule (module docstring).
    min_pixels / max_pixels: the budget of frames * height * width after resizing;
        `--vision-max-merged N` lowers it (and max_frames) to fit N merged tokens (`capped`).
    max_seconds: longer videos are refused before decoding them whole.
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096
    max_pixels: int = 25165824
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_seconds: float = 3600.0

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def capped(self, max_merged: int | None) -> "VideoRules":
        """At most `max_merged` merged tokens per video (None: unchanged). A frame group costs
        at least one merged token, so the frames are capped too."""
        if max_merged is None:
            return self
        cap = max_merged * self.temporal_patch_size * self.factor * self.factor
        frames = max_merged * self.temporal_patch_size
        return replace(self, min_pixels=min(self.min_pixels, cap),
                       max_pixels=min(self.max_pixels, cap),
                       min_frames=min(self.min_frames, frames),
                       max_frames=min(self.max_frames, frames))


@dataclass(frozen=True)
class DecodedVideo:
    """frames: uint8 [n, H, W, 3], the sampled frames; indices: their frame numbers in the
    stream; fps: the stream's frame rate."""

    frames: np.ndarray
    indices: tuple[int, ...]
    fps: float


@dataclass(frozen=True)
class PreparedVideo:
    """One video ready for the tower.

    patches: float32 [grid_t * grid_h * grid_w, patch_dim], frame group by frame group, each
        group in merge-window order (as `runtime.media.image.PreparedImage`).
    grid: (grid_t, grid_h, grid_w); timestamps: each group's time in seconds.
    digest: sha256 of the sampled frames, their indices and the grid; group g is keyed
        `digest:g` (the encoder cache and the prefix cache).
    """

    patches: np.ndarray
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]
    digest: str

    def group_tokens(self, merge_size: int) -> int:
        """Merged tokens of one frame group."""
        return (self.grid[1] // merge_size) * (self.grid[2] // merge_size)

    def group(self, g: int) -> tuple[np.ndarray, tuple[int, int, int], str]:
        """(patches, grid (1, h, w), digest) of frame group g: the tower's input for one block."""
        rows = self.grid[1] * self.grid[2]
        return self.patches[g * rows:(g + 1) * rows], (1, *self.grid[1:]), f"{self.digest}:{g}"

    def prompt_text(self) -> str:
        """What replaces the template's one `VIDEO_BLOCK`: its outer markers around one block
        per group, one pad each (`placement.expand_pads` widens each)."""
        start, _, end = VIDEO_BLOCK
        return start + "".join(f"<{t:.1f} seconds>" + "".join(VIDEO_BLOCK)
                               for t in self.timestamps) + end


def sample_indices(total: int, fps: float, rules: VideoRules) -> np.ndarray:
    """The frame numbers to keep of a `total`-frame stream at `fps` (module docstring)."""
    count = int(total / fps * rules.fps)
    count = min(max(count, rules.min_frames), rules.max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def decode_video(data: bytes, where: str, rules: VideoRules) -> DecodedVideo:
    """Encoded bytes -> the sampled frames. The frame count comes from the container, or from
    counting its packets when it states none; only the sampled frames are kept in memory."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                # An MP4 whose video track has no samples shows no stream at all.
                raise MediaError(where, "the file holds no video frames (no video stream)")
            stream = container.streams.video[0]
            pixels = stream.codec_context.width * stream.codec_context.height
            if pixels > MAX_DECODED_PIXELS:
                raise MediaError(where, f"a frame is larger than {MAX_DECODED_PIXELS} pixels")
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else DEFAULT_FPS
            total = stream.frames or _count_packets(container, stream)
            if total == 0:
                raise MediaError(where, "the file holds no video frames")
            if total / fps > rules.max_seconds:
                raise MediaError(where, f"the video lasts {total / fps:.1f} s, over the "
                                        f"{rules.max_seconds:g} s limit")
        wanted = sample_indices(total, fps, rules)
        decoded_bytes = len(wanted) * pixels * 3
        if decoded_bytes > MAX_SAMPLED_BYTES:
            raise MediaError(where, f"the {len(wanted)} sampled frames need "
                                    f"{decoded_bytes / (1 << 30):.1f} GiB decoded, over the "
                                    f"{MAX_SAMPLED_BYTES / (1 << 30):.0f} GiB limit (send a "
                                    "shorter or smaller video)")
        with av.open(io.BytesIO(data)) as container:      # anew: counting consumed the packets
            frames = _decode_frames(container, container.streams.video[0],
                                    set(wanted.tolist()), where)
    except MediaError:
        raise
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, StopIteration) as exc:
        raise MediaError(where, f"not a decodable video ({type(exc).__name__}: {exc})") \
            from None
    missing = [int(i) for i in wanted if int(i) not in frames]
    if missing:
        raise MediaError(where, f"only {len(wanted) - len(missing)} of the {len(wanted)} sampled "
                                f"frames could be decoded (truncated or corrupt video)")
    return DecodedVideo(frames=np.stack([frames[int(i)] for i in wanted]),
                        indices=tuple(int(i) for i in wanted), fps=fps)


def _count_packets(container, stream) -> int:
    """Frames of a stream whose container states no count (WebM, Matroska): its packets, up
    to the end of the file or of what is left of it."""
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            count += bool(packet.size)         # the demuxer ends with an empty flush packet
    except av.error.EOFError:                  # a cut file ends inside a cluster
        pass
    return count


def _decode_frames(container, stream, wanted: set[int], where: str) -> dict[int, np.ndarray]:
    frames: dict[int, np.ndarray] = {}
    shape = None
    for index, frame in enumerate(container.decode(stream)):
        if index in wanted:
            if frame.width * frame.height > MAX_DECODED_PIXELS:
                raise MediaError(where, f"a frame is larger than {MAX_DECODED_PIXELS} pixels")
            pixels = frame.to_ndarray(format="rgb24")
            if shape is not None and pixels.shape != shape:
                raise MediaError(where, "the video changes frame size mid-stream")
            shape = pixels.shape
            frames[index] = pixels
        if index >= max(wanted):
            break
    return frames


def smart_resize_video(frames: int, height: int, width: int, rules: VideoRules,
                       where: str = "video") -> tuple[int, int]:
    """Target (height, width) of every frame: multiples of `rules.factor`, with
    frames (rounded to the temporal patch) * height * width within the pixel budget."""
    factor, temporal = rules.factor, rules.temporal_patch_size
    # The reference refuses a clip shorter than one temporal patch; its padded pair is budgeted.
    frames = max(frames, temporal)
    if height < factor or width < factor:          # tiny clips are first scaled up to one factor
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(where, f"aspect ratio {max(height, width) / min(height, width):.0f} "
                                f"is over {MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > rules.max_pixels:
        beta = math.sqrt(frames * height * width / rules.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < rules.min_pixels:
        beta = math.sqrt(rules.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def group_timestamps(indices: tuple[int, ...], fps: float, temporal: int) -> tuple[float, ...]:
    """Each frame group's time: the mean of its first and last frame's (the padded index list
    repeats the last frame, as the frames are)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [index / fps for index in padded]
    return tuple((seconds[i] + seconds[i + temporal - 1]) / 2
                 for i in range(0, len(seconds), temporal))


def prepare_video(video: DecodedVideo, rules: VideoRules, where: str = "video") -> PreparedVideo:
    """Sampled frames -> the tower's patches (see `PreparedVideo`)."""
    count, height, width, _ = video.frames.shape
    new_h, new_w = smart_resize_video(count, height, width, rules, where)
    mean = np.asarray(rules.mean, np.float64)
    std = np.asarray(rules.std, np.float64)
    clip = np.empty((count, 3, new_h, new_w), np.float32)
    for i, frame in enumerate(video.frames):     # frame by frame: float64 copies stay small
        resized = np.clip(np.round(resize(frame, new_h, new_w)), 0, 255)
        clip[i] = ((resized / 255.0 - mean) / std).transpose(2, 0, 1)
    p, tp, m = rules.patch_size, rules.temporal_patch_size, rules.merge_size
    if count % tp:                                   # odd count: repeat the last frame
        clip = np.concatenate([clip, np.repeat(clip[-1:], tp - count % tp, axis=0)])
    gt, gh, gw = clip.shape[0] // tp, new_h // p, new_w // p
    cubes = clip.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    # -> [gt, gh/m, gw/m, m, m, 3, tp, p, p]: group, merge window, position in it, Conv3d order.
    cubes = cubes.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = np.ascontiguousarray(cubes.reshape(gt * gh * gw, 3 * tp * p * p))
    grid = (gt, gh, gw)
    digest = hashlib.sha256(video.frames.tobytes() + f"{video.frames.shape}{video.indices}"
                            f"{grid}".encode()).hexdigest()
    return PreparedVideo(patches=patches, grid=grid,
                         timestamps=group_timestamps(video.indices, video.fps, tp), digest=digest)
