"""Golden data for video on the NumPy vision path, from Hugging Face transformers' Qwen3.5.

The model is the one of `make_golden_vision` (its committed weights in tests/data/golden/vision
are loaded, so both golden sets describe one model). The video is synthetic: 20 frames at 8 fps
(2.5 s) of 72 x 100 px moving shapes, encoded losslessly (FFV1 in Matroska) so that any `av`
decodes the same pixels. The oracle for each step:

- frame sampling: `Qwen3VLVideoProcessor.sample_frames` (fps 2 -> 5 frames: an odd count);
- resize: torch's antialiased bicubic (what the processor's torchvision resize runs; torchvision
  itself is not needed), rounded to uint8; the budget from the processor's `smart_resize`;
- padding to the temporal patch and the patch layout: the processor's `patchify`;
- timestamps: `Qwen3VLProcessor._calculate_timestamps`;
- tower, MRoPE positions (`get_rope_index`, which splits the video into one-frame groups), the
  full-prompt logits and one cached decode step: the model.

golden.npz:
    video [bytes] uint8: the encoded file; frames [5, 72, 100, 3] uint8: the sampled frames
        (decoded by av here, independently of runtime.media); indices [5]; fps [];
    pixel_values [72, 1536] float32, grid [3]: the processor's tower input (3 groups of 4 x 6);
    timestamps [3]; video_embeds [18, 64]: the merger's outputs;
    ids [T] int64: text, <|vision_start|>, per group <t seconds> (stand-in text ids)
        <|vision_start|> 6 pads <|vision_end|>, <|vision_end|>, text (the processor keeps the
        template's outer markers and replaces its one pad); positions [3, T]; logits [T, V];
        decode_logits [V].

Made on the CPU (2 cores, torch 2.13.0+cpu, transformers 5.24.0, av 18.1.0, a few seconds):

    python tools/make_golden_video.py --out tests/data/golden/video

Needs torch, transformers, safetensors and av: a dev tool, never imported by the runtime.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import av
import numpy as np
import torch
import transformers
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.make_golden_vision import (SEED, VIDEO_TOKEN, VISION_END, VISION_START,  # noqa: E402
                                      build_model)

VISION_GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden" / "vision"
FRAMES, FPS, HEIGHT, WIDTH = 20, 8, 72, 100
# Frames x pixels budget: 5 frames (t_bar 4) of 64 x 96 = 24576 lies inside it, so the clip
# is resized only to multiples of 32: 72 x 100 -> 64 x 96, grid 3 x 4 x 6 after padding to 6.
MIN_PIXELS, MAX_PIXELS = 4 * 32 * 32 * 2, 16 * 32 * 32 * 2


def synthetic_frames() -> np.ndarray:
    """A square and a disc crossing a gradient: frames that differ, so time matters."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    frames = []
    for t in range(FRAMES):
        frame = np.stack([x * 255 // WIDTH, y * 255 // HEIGHT,
                          np.full_like(x, 40 + 8 * t)], axis=-1).astype(np.uint8)
        left = 4 * t
        frame[10:30, left:left + 20] = (250, 30, 30)
        frame[(y - 50) ** 2 + (x - 90 + 3 * t) ** 2 < 100] = (20, 220, 60)
        frames.append(frame)
    return np.stack(frames)


def encode(frames: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def preprocess(data: bytes):
    """(frames, indices, fps, pixel_values, grid, timestamps) by transformers' own steps."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (Qwen3VLVideoProcessor,
                                                                        smart_resize)
    from transformers.video_utils import VideoMetadata

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    processor = Qwen3VLVideoProcessor()
    indices = processor.sample_frames(VideoMetadata(total_num_frames=len(decoded), fps=fps))
    frames = decoded[indices]
    height, width = smart_resize(len(frames), HEIGHT, WIDTH, temporal_factor=2, factor=32,
                                 min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    clip = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    clip = torch.nn.functional.interpolate(clip, size=(height, width), mode="bicubic",
                                           antialias=True, align_corners=False)
    clip = (clip.round().clamp(0, 255) / 255.0 - 0.5) / 0.5
    pixel_values, gt, gh, gw = processor.patchify(clip[None], patch_size=16, merge_size=2,
                                                  temporal_patch_size=2)
    timestamps = Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)
    return frames, indices, fps, pixel_values[0], torch.tensor([[gt, gh, gw]]), timestamps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    _, model = build_model()
    state = load_file(str(VISION_GOLDEN / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    data = encode(synthetic_frames())
    frames, indices, fps, pixel_values, grid, timestamps = preprocess(data)
    rng = np.random.default_rng(SEED + 1)
    text = lambda n: rng.integers(0, 490, n).tolist()  # noqa: E731 (ids below the specials)
    per_group = int(grid[0, 1] * grid[0, 2]) // 4
    ids = text(5) + [VISION_START]
    for _ in range(int(grid[0, 0])):
        ids += text(3) + [VISION_START] + [VIDEO_TOKEN] * per_group + [VISION_END]
    ids += [VISION_END] + text(6)
    input_ids = torch.tensor([ids])
    types = (input_ids == VIDEO_TOKEN).int() * 2
    with torch.no_grad():
        embeds = model.model.get_video_features(pixel_values, grid,
                                                return_dict=True).pooler_output[0]
        positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=types,
                                                  video_grid_thw=grid.clone())
        logits = model(input_ids=input_ids, pixel_values_videos=pixel_values,
                       video_grid_thw=grid, mm_token_type_ids=types).logits[0]
        model.model.rope_deltas = None
        prefix = model(input_ids=input_ids[:, :-1], pixel_values_videos=pixel_values,
                       video_grid_thw=grid, mm_token_type_ids=types[:, :-1], use_cache=True)
        decode = model(input_ids=input_ids[:, -1:], cache=prefix.past_key_values,
                       use_cache=True, mm_token_type_ids=types[:, -1:]).logits[0, -1]
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out / "golden.npz", video=np.frombuffer(data, np.uint8), frames=frames,
        indices=np.asarray(indices, np.int64), fps=np.float64(fps),
        pixel_values=pixel_values.numpy(), grid=grid[0].numpy(),
        timestamps=np.asarray(timestamps), video_embeds=embeds.numpy(),
        ids=np.array(ids, np.int64), positions=positions[:, 0].numpy(), logits=logits.numpy(),
        decode_logits=decode.numpy())
    print(f"wrote {args.out}: {len(data)} byte video, grid {grid[0].tolist()}, T={len(ids)}, "
          f"max |logit| {float(logits.abs().max()):.4f}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, av {av.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
