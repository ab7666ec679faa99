"""The session's backend: which device runs the model (`--device`) and the runner built for it.

`cpu` is the NumPy reference runner (tiny models, float32); `cuda` the CUDA runner, imported
by name (`CUDA_RUNNER_MODULE`) only when a GPU is chosen; `auto` is cuda when a CUDA driver
reports a device, else cpu. The GPU check goes through ctypes only, so choosing needs no CUDA
package.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
from typing import Any, Optional

import numpy as np

from runtime.config import ConfigError
from runtime.log import Progress
from runtime.model.config import ModelConfig

CUDA_RUNNER_MODULE = "runtime.model.gpu.runner"


def gpu_present() -> bool:
    """A CUDA driver that reports at least one device (checked through ctypes only)."""
    name = ctypes.util.find_library("cuda")
    if name is None:
        return False
    try:
        driver = ctypes.CDLL(name)
        if driver.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        return driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except OSError:
        return False


def choose_device(setting: str) -> str:
    """"cpu" or "cuda" from `--device` (cpu | cuda | N | auto)."""
    if setting == "cpu":
        return "cpu"
    if setting == "cuda" or setting.isdigit():
        if not gpu_present():
            raise ConfigError(f"--device {setting}: no CUDA GPU is visible here; use "
                              "--device cpu (NumPy reference backend, tiny models)")
        return "cuda"
    if setting != "auto":
        raise ConfigError(f"--device: {setting!r} is not cpu, cuda, a device index or auto")
    return "cuda" if gpu_present() else "cpu"


class _WeightProgress:
    """Weight upload progress (bytes): one transient line on a terminal, coarse plain lines
    when stderr is redirected (runtime.log.Progress)."""

    def __init__(self):
        self._progress: Optional[Progress] = None

    def __call__(self, done: int, total: int) -> None:
        if self._progress is None:
            self._progress = Progress("materializing weights", total, unit="B")
        self._progress.advance(done - self._progress.done)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()


def synthetic_shape(name: str, artifact_config: dict) -> ModelConfig:
    """`--synthetic-shape NAME|FILE` as a config; its vocabulary must be the artifact's (the
    tokenizer and the sampled ids come from there). BF16 weights."""
    from runtime.model.shapes import shape_config

    try:
        config = ModelConfig.from_dict(shape_config(name))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--synthetic-shape: {exc}") from None
    vocab = artifact_config.get("vocab_size")
    if config.vocab_size != vocab:
        raise ConfigError(f"--synthetic-shape {name}: vocabulary of {config.vocab_size} tokens, the "
                          f"model's tokenizer has {vocab} (give a MODEL of the same vocabulary, e.g. "
                          "one written by `python -m tools.make_tiny --vocab real`)")
    return config


def make_runner(device: str, artifact: Any, num_pages: int, num_lanes: int, num_slots: int,
                prefill_chunk: int, settings: Any, logger, mtp: bool = False, vision: bool = False,
                shape_config: Optional[ModelConfig] = None) -> Any:
    """The runner for `device` over the opened artifact.

    num_lanes: sequences decoded together (the CUDA runner's batch bucket). num_slots: the lanes
    and their verification snapshots, then the prefix cache's snapshot slots. mtp: load the MTP
    head (with --synthetic-weights a random one of the config's shape). vision:
    load the vision tower (the artifact's, so not with --synthetic-weights). shape_config:
    `--synthetic-shape` as `synthetic_shape` read it."""
    synthetic, shape_name = settings.synthetic_weights, settings.synthetic_shape
    draft_vocab = settings.mtp_draft_vocab if mtp else None
    if shape_name is not None and synthetic is None:
        raise ConfigError("--synthetic-shape runs a shape on random weights: give --synthetic-weights SEED too")
    if synthetic is not None and device != "cuda":
        raise ConfigError(f"--synthetic-weights fills weights on the GPU; the {device} backend "
                          "reads them from the model (use --device cuda)")
    if device == "cuda":
        if settings.device.isdigit() and settings.device != "0":
            raise ConfigError(f"--device {settings.device}: the CUDA runner drives device 0 "
                              "only so far")
        module = importlib.import_module(CUDA_RUNNER_MODULE)
        progress = _WeightProgress()
        shape = {"num_pages": num_pages, "num_slots": num_slots,
                 "max_batch": min(b for b in (1, 2, 4, 8) if b >= num_lanes),
                 "prefill_chunk": prefill_chunk, "max_context": settings.max_context,
                 "cuda_graphs": not settings.no_cuda_graph, "mtp_draft_vocab": draft_vocab,
                 "kv_dtype": settings.kv_dtype}
        if vision and synthetic is not None:
            raise ConfigError("--vision loads the artifact's vision tower; --synthetic-weights has none")
        try:
            if synthetic is not None:
                logger.warning("--synthetic-weights %d: random weights, the output is noise",
                               synthetic)
                text = artifact.component("text")
                if shape_config is not None:
                    return module.CudaRunner.synthetic(shape_config, synthetic, mtp=mtp, **shape)
                config = ModelConfig.from_dict(text.config)
                # The artifact's projection formats (an FP8 model gets random FP8 weights).
                return module.CudaRunner.synthetic(config, synthetic, mtp=mtp, **shape,
                                                   weight_formats=lambda name: text.entry(name).format)
            return module.CudaRunner.from_artifact(artifact, progress=progress, mtp=mtp, vision=vision, **shape)
        except NotImplementedError as exc:      # a model the CUDA runner cannot run yet
            raise ConfigError(f"--device cuda: {exc}; --device cpu runs it on the NumPy "
                              "reference") from None
        finally:
            progress.close()
    from runtime.model.numpy_runner import NumpyRunner

    if settings.kv_dtype != "bf16":
        raise ConfigError(f"--kv-dtype {settings.kv_dtype}: the CPU backend keeps KV in "
                          "float32 and accepts only the default bf16; fp8 and int8 KV run on "
                          "the CUDA backend (--device cuda)")
    logger.debug("CPU backend: NumPy reference in float32 (KV kept in float32; "
                 "--no-cuda-graph has no effect)")
    return NumpyRunner.from_artifact(artifact, num_pages=num_pages, num_slots=num_slots,
                                     dtype=np.float32, mtp=mtp, vision=vision,
                                     mtp_draft_vocab=draft_vocab)
