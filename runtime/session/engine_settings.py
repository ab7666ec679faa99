"""Settings translated into what the engine and the runner are built with, refusing what
cannot work: the KV pool size, the prefix cache's `EngineConfig` fields, speculative decoding
(`SpeculativeConfig`), the state slots the runner allocates, and `--vision` (the tower's config
and the image rules; it rules out speculative decoding). Every refusal is a `ConfigError`
naming the option, never a setting silently ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from runtime.config import ConfigError, serving
from runtime.engine.kv_pages import pages_for
from runtime.engine.speculative import MAX_MTP_DRAFTS, SlotLayout, SpeculativeConfig
from runtime.model.runner import PAGE_SIZE


def kv_pool_pages(settings: Any, device: str, num_lanes: int, logger) -> int:
    """KV pages for `--kv-capacity` tokens, by default (and, on the CPU, for `auto`)
    `--max-context` times the lanes."""
    capacity = settings.kv_capacity
    if capacity is None or capacity == "auto":
        if capacity == "auto" and device == "cpu":
            logger.info("--kv-capacity auto: the CPU backend sizes the pool from "
                        "--max-context")
        capacity = settings.max_context * num_lanes
    return pages_for(capacity)


def prefix_cache_settings(settings: Any) -> dict:
    """The prefix cache's `EngineConfig` fields from the server's options. The CLI (one
    request) has no cache options and no cache."""
    off = {"prefix_cache": False, "snapshot_slots": 0, "host_cache_bytes": 0,
           "snapshot_interval": 0, "cache_file": None, "ssd_bytes": 0, "ssd_dir": None}
    if not serving(settings):
        return off
    interval = settings.snapshot_interval
    if interval % PAGE_SIZE:
        raise ConfigError(f"--snapshot-interval: {interval} is not a multiple of {PAGE_SIZE}")
    return {"prefix_cache": not settings.no_prefix_cache,
            "snapshot_slots": settings.device_snapshot_slots,
            "host_cache_bytes": settings.host_context_mib << 20,
            "snapshot_interval": interval,
            "cache_file": settings.prefix_cache_file,    # fingerprinted once the runner exists
            "cache_save_s": settings.prefix_cache_save_mins * 60.0,
            **disk_tier_settings(settings)}


def disk_tier_settings(settings: Any) -> dict:
    """`--ssd-context-gib N --ssd-context-dir DIR --ssd-context-gib-per-hour M` as the disk
    tier's `EngineConfig` fields; a tier that cannot work is a ConfigError at startup, not a
    failed write later."""
    gib, directory = settings.ssd_context_gib, settings.ssd_context_dir
    if not gib:
        if directory is not None:
            raise ConfigError("--ssd-context-dir: the disk tier is off; give its size with "
                              "--ssd-context-gib N")
        return {"ssd_bytes": 0, "ssd_dir": None}
    if directory is None:
        raise ConfigError("--ssd-context-gib needs --ssd-context-dir DIR (a directory on the "
                          "SSD for the disk tier's files)")
    if not os.path.isdir(directory):
        raise ConfigError(f"--ssd-context-dir: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"--ssd-context-dir: {directory} is not writable")
    if settings.no_prefix_cache:
        raise ConfigError("--ssd-context-gib: the disk tier holds shared snapshots, which "
                          "--no-prefix-cache turns off")
    return {"ssd_bytes": gib << 30, "ssd_dir": os.path.abspath(directory),
            "ssd_write_bytes_per_hour": settings.ssd_context_gib_per_hour << 30}


def route_summary(device: str, cache: dict) -> str:
    """The startup line naming the route and what it keeps request-invariant (a request's
    tokens independent of what runs beside it; docs/architecture.md, "Request invariance")."""
    kernels = "CUDA kernels" if device == "cuda" else "NumPy reference"
    kept = "resumes from its saved state" if cache["prefix_cache"] or cache["host_cache_bytes"] \
        else "replays its output by prefill (rounding may differ)"
    line = (f"route: {kernels}; request-invariant across batching and joins/leaves; a request "
            f"preempted under KV pressure {kept}")
    if cache["prefix_cache"]:
        line += ("; prefix-cache resumes are exact (only at the request's own chunk stops, from "
                 "state computed by prefill: docs/prefix_cache.md)")
    return line


def cache_fingerprint(model_name: str, model_path: Path, runner: Any, kv_dtype: str) -> str:
    """What a prefix-cache file's arrays depend on: the model and the exact artifact file,
    the runner (its class; its compute dtype shows in the sizes), the KV format and the state
    and page sizes."""
    stat = model_path.stat()
    return (f"model={model_name};artifact={model_path.name}:{stat.st_size}:{stat.st_mtime_ns};"
            f"runner={type(runner).__name__};kv={kv_dtype};rules=prefill-only;"
            f"slot={runner.slot_nbytes};page={runner.page_nbytes}")


def vision_settings(settings: Any, device: str, artifact: Any,
                    speculative: SpeculativeConfig) -> Optional[tuple[Any, Any]]:
    """(VisionConfig, MediaRules) for --vision, None without it; refuses what cannot run."""
    if not settings.vision:
        return None
    from runtime.media.image import ImageRules
    from runtime.media.placement import MediaRules
    from runtime.media.video import VideoRules
    from runtime.model.vision_reference import VisionConfig

    if "vision" not in artifact.all_component_names:
        raise ConfigError("--vision: this model has no vision component (convert a checkpoint "
                          "with model.visual.* tensors)")
    if speculative.mtp or speculative.ngram_draft_tokens:
        raise ConfigError("--vision with speculative decoding is not supported yet")
    config = artifact.component("vision").config
    tower = VisionConfig.from_dict(config)
    shape = dict(patch_size=tower.patch_size, temporal_patch_size=tower.temporal_patch_size,
                 merge_size=tower.spatial_merge_size)
    processor = config.get("image_processor") or {}
    defaults = ImageRules()
    image = ImageRules(**shape,
                       min_pixels=int(processor.get("min_pixels") or defaults.min_pixels),
                       max_pixels=int(processor.get("max_pixels") or defaults.max_pixels),
                       mean=tuple(processor.get("mean") or defaults.mean),
                       std=tuple(processor.get("std") or defaults.std))
    # Without a video processor config (older artifacts) Qwen3.5's published values apply.
    processor = config.get("video_processor") or {}
    fallback = VideoRules()
    video = VideoRules(**shape, fps=float(processor.get("fps") or fallback.fps),
                       min_frames=int(processor.get("min_frames") or fallback.min_frames),
                       max_frames=int(processor.get("max_frames") or fallback.max_frames),
                       min_pixels=int(processor.get("min_pixels") or fallback.min_pixels),
                       max_pixels=int(processor.get("max_pixels") or fallback.max_pixels),
                       mean=tuple(processor.get("mean") or fallback.mean),
                       std=tuple(processor.get("std") or fallback.std))
    return tower, MediaRules(image=image.capped(settings.vision_max_merged),
                             video=video.capped(settings.vision_max_merged))


def speculative_settings(settings: Any, device: str, artifact: Any) -> SpeculativeConfig:
    """`--spec`, `--draft-tokens` and `--ngram-*` as the engine's config; combinations that
    cannot work are ConfigErrors, never ignored."""
    if settings.draft_tokens is not None and settings.spec != "mtp":
        raise ConfigError("--draft-tokens sets the MTP drafts per round: it needs --spec mtp")
    if settings.mtp_draft_vocab is not None:
        if settings.spec != "mtp":
            raise ConfigError("--mtp-draft-vocab sets the MTP drafts' vocabulary: it needs --spec mtp")
        vocab = artifact.component("text").config["vocab_size"]
        if settings.mtp_draft_vocab > vocab:
            raise ConfigError(f"--mtp-draft-vocab {settings.mtp_draft_vocab}: the model has {vocab} token ids")
    adaptive = settings.draft_tokens == "auto"
    config = SpeculativeConfig(method=settings.spec,
                               draft_tokens=MAX_MTP_DRAFTS if adaptive else settings.draft_tokens or 3,
                               ngram_draft_tokens=settings.ngram_draft_tokens,
                               ngram_min_match=settings.ngram_min_match, adaptive=adaptive)
    if not config.enabled:
        return config
    # Synthetic weights fill a random MTP head of the config's shape (CudaRunner), file or not.
    if config.mtp and "mtp" not in artifact.all_component_names and settings.synthetic_weights is None:
        raise ConfigError("--spec mtp: this artifact has no MTP component (convert the "
                          "checkpoint with its mtp.* weights, or use --spec off)")
    return config


def runner_slots(num_lanes: int, speculative: SpeculativeConfig, cache: dict) -> int:
    """State slots the runner allocates: the lanes and their verification snapshots, then the
    prefix cache's snapshot slots (`cache`: the `prefix_cache_settings` fields)."""
    return SlotLayout.for_config(num_lanes, speculative).reserved + cache["snapshot_slots"]
