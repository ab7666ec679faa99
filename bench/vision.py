"""Vision-tower encode time on the GPU: Qwen3.5-27B's tower shape (27 blocks of width 1152, 16
heads of 72, merger 4 x 1152 -> 5120) with synthetic weights.

    python -m bench.vision --out results/ [--megapixels 1,4,16] [--video-seconds 10] [--seed 0]

Images: a square image of each size goes through the model's resize rule (Qwen3.5's image
processor: multiples of 32 pixels, at most 16,777,216 pixels, so 16 MP is the cap) and the
table reports the patch grid and the merged tokens it becomes. Video: a 1280 x 720, 30 fps clip
of `--video-seconds` sampled and resized by the video rule (2 frames a second, a frame group of 2
frames a second, the frames' pixel budget), encoded in one call (one attention group per frame
group) and reported per video second. Times are GPU time of the tower's launches (CUDA events;
the host plan and the uploads are reported apart), the median of 3 runs after a warm-up, except
above `--single-run-patches` patches where one run is timed (the CUDA-core attention makes a
16 MP image many seconds). The per-kernel share of each run shows what dominates. Writes
`vision.json` and `vision.md` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.timing import median_event_seconds, plan_breakdown_us
from runtime.media.image import ImageRules, smart_resize
from runtime.media.video import VideoRules, sample_indices, smart_resize_video
from runtime.model.gpu.vision_synthetic import QWEN35_27B_VISION, synthetic_weights
from runtime.model.vision_reference import VisionConfig

VIDEO_SIZE, VIDEO_FPS = (720, 1280), 30.0


def image_grid(megapixels: float, rules: ImageRules, patch: int) -> tuple[int, int, int]:
    side = int(round(np.sqrt(megapixels * 1024 * 1024)))
    h, w = smart_resize(side, side, rules)
    return 1, h // patch, w // patch


def video_grid(seconds: float, rules: VideoRules, patch: int) -> tuple[int, int, int]:
    frames = len(sample_indices(int(seconds * VIDEO_FPS), VIDEO_FPS, rules))
    h, w = smart_resize_video(frames, *VIDEO_SIZE, rules)
    return -(-frames // rules.temporal_patch_size), h // patch, w // patch


def measure(tower: Any, grid: tuple[int, int, int], single_run_patches: int, seed: int) -> dict[str, Any]:
    """GPU seconds of one encode of `grid` (median of 3 or one run), host plan seconds and the
    per-kernel breakdown."""
    from runtime.model.gpu.vision_plan import plan_items

    c = tower.config
    t, h, w = grid
    patches = np.random.default_rng(seed).standard_normal((t * h * w, c.patch_dim)).astype(np.float32)
    start = time.perf_counter()
    plan = plan_items(c, [grid])
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    tower.upload(patches, plan)
    tower.stream.synchronize()
    upload_s = time.perf_counter() - start
    launches = tower.launches(plan)
    breakdown = plan_breakdown_us(tower.device, tower.stream, launches)
    if plan.rows > single_run_patches:
        gpu_s = sum(breakdown.values()) / 1e6
    else:
        gpu_s = median_event_seconds(tower.device, tower.stream,
                                     lambda s: [launch(s) for launch in launches], repeats=3)
    total_us = sum(breakdown.values())
    share: dict[str, float] = {}
    for name, us in breakdown.items():
        family = name.split("/")[0]
        share[family] = share.get(family, 0.0) + us / total_us
    return {"grid": list(grid), "patches": plan.rows, "merged_tokens": plan.rows // c.spatial_merge_size ** 2,
            "gpu_s": gpu_s, "host_plan_s": plan_s, "upload_s": upload_s,
            "share": {k: round(v, 4) for k, v in sorted(share.items(), key=lambda kv: -kv[1])},
            "kernels_us": {k: round(v, 1) for k, v in breakdown.items()}}


def render(report: dict[str, Any]) -> str:
    lines = ["| input | grid (t, h, w) | patches | merged tokens | GPU s | host plan s | upload s | "
             "attention share |", "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['input']} | {tuple(row['grid'])} | {row['patches']} | {row['merged_tokens']} | "
                     f"{row['gpu_s']:.3f} | {row['host_plan_s']:.3f} | {row['upload_s']:.3f} | "
                     f"{row['share'].get('vision_attention', 0.0):.0%} |")
    video = next((r for r in report["rows"] if r["input"].startswith("video")), None)
    if video is not None:
        lines.append("")
        lines.append(f"Video: {video['gpu_s'] / report['video_seconds']:.3f} GPU s per video second "
                     f"({video['merged_tokens'] / report['video_seconds']:.0f} merged tokens per second).")
    lines.append("")
    lines.append(f"{report['device']}; tower: {report['tower']}; synthetic weights (seed {report['seed']}).")
    return "\n".join(lines) + "\n"


def main() -> None:
    from runtime.cuda.device import CudaDevice
    from runtime.cuda.kernels import KernelLibrary
    from runtime.model.gpu.vision import GpuVisionTower

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results"), help="folder for vision.json and vision.md")
    ap.add_argument("--megapixels", default="1,4,16", help="image sizes, comma-separated")
    ap.add_argument("--video-seconds", type=float, default=10.0, help="clip length (0: no video)")
    ap.add_argument("--single-run-patches", type=int, default=20000,
                    help="above this many patches time one run instead of the median of 3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    config = VisionConfig.from_dict(QWEN35_27B_VISION)
    patch = config.patch_size
    image_rules = ImageRules(patch_size=patch, temporal_patch_size=config.temporal_patch_size,
                             merge_size=config.spatial_merge_size)
    video_rules = VideoRules(patch_size=patch, temporal_patch_size=config.temporal_patch_size,
                             merge_size=config.spatial_merge_size)
    inputs = [(f"image {mp:g} MP", image_grid(mp, image_rules, patch)) for mp in map(float, args.megapixels.split(","))]
    if args.video_seconds > 0:
        inputs.append((f"video {args.video_seconds:g} s 720p", video_grid(args.video_seconds, video_rules, patch)))
    most = max(int(np.prod(g)) for _, g in inputs)
    device = CudaDevice(0)
    library = KernelLibrary.open(device, required=[])
    start = time.perf_counter()
    tower = GpuVisionTower(config, synthetic_weights(config, args.seed), device=device, library=library,
                           max_patches=most + (-most) % 4)
    print(json.dumps({"tower_ready_s": round(time.perf_counter() - start, 1), "max_patches": most}), flush=True)
    # A small warm-up loads every kernel's module before anything is timed.
    measure(tower, (1, 16, 16), args.single_run_patches, args.seed)
    rows = []
    for name, grid in inputs:
        row = {"input": name, **measure(tower, grid, args.single_run_patches, args.seed)}
        print(json.dumps({k: v for k, v in row.items() if k != "kernels_us"}), flush=True)
        rows.append(row)
    tower.close()
    report = {"device": device.describe()["name"], "tower": "Qwen3.5-27B (27 x 1152, 16 x 72 heads, MLP 4304)",
              "seed": args.seed, "video_seconds": args.video_seconds, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vision.json").write_text(json.dumps(report, indent=1))
    (args.out / "vision.md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
