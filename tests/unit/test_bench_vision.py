"""`bench/vision.py`'s inputs and report on the CPU: the grids the model's resize rules give for
the benchmarked sizes, and the Markdown table (the GPU timings come from the H200 run)."""

from __future__ import annotations

from bench.vision import image_grid, render, video_grid
from runtime.media.image import ImageRules
from runtime.media.video import VideoRules


def test_grids_follow_the_models_rules():
    rules = ImageRules(patch_size=16, temporal_patch_size=2, merge_size=2)
    assert image_grid(1, rules, 16) == (1, 64, 64)          # 1024 x 1024: 1024 merged tokens
    assert image_grid(4, rules, 16) == (1, 128, 128)
    assert image_grid(16, rules, 16) == (1, 256, 256)       # exactly the 16,777,216-pixel cap
    assert image_grid(64, rules, 16) == (1, 256, 256)       # larger images are scaled down to it
    # 10 s of 30 fps 720p: 20 sampled frames (2 a second) in 10 groups of 2, 704 x 1280 each.
    assert video_grid(10, VideoRules(patch_size=16, temporal_patch_size=2, merge_size=2), 16) == (10, 44, 80)


def test_render_reports_merged_tokens_and_video_rate():
    row = {"grid": [1, 64, 64], "patches": 4096, "merged_tokens": 1024, "gpu_s": 0.25, "host_plan_s": 0.01,
           "upload_s": 0.002, "share": {"vision_attention": 0.5}}
    video = dict(row, input="video 10 s 720p", grid=[10, 44, 80], patches=35200, merged_tokens=8800, gpu_s=2.0)
    text = render({"rows": [dict(row, input="image 1 MP"), video], "video_seconds": 10.0, "device": "H200",
                   "tower": "27B", "seed": 0})
    assert "| image 1 MP | (1, 64, 64) | 4096 | 1024 | 0.250 | 0.010 | 0.002 | 50% |" in text
    assert "0.200 GPU s per video second (880 merged tokens per second)" in text
