"""Where a session's model comes from: the `.infernix` file named by the settings (checked
before anything loads), or with `--demo` a tiny real-vocabulary model generated once with
`tools.make_tiny` and cached under $INFERNIX_CACHE or ~/.cache/infernix (the demo always runs
on the CPU).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from runtime.config import ConfigError
from runtime.session.backend import choose_device

DEMO_SEED = 0


def cache_dir() -> Path:
    """$INFERNIX_CACHE, or ~/.cache/infernix."""
    root = os.environ.get("INFERNIX_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "infernix"


def demo_model_path(logger=None) -> Path:
    """The cached tiny demo model (real Qwen vocabulary, random weights); built on first use,
    which takes seconds: `logger` (when given) says so, with the build's phases."""
    path = cache_dir() / f"demo-tiny-dense-real-seed{DEMO_SEED}.infernix"
    if path.exists():
        return path
    from tools.make_tiny import make_tiny    # build-time tool; only the demo needs it

    def phase(text: str) -> None:
        if logger is not None:
            logger.info("demo: %s", text)

    phase(f"first run: building the demo model once (about 10 s), cached as {path}")
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.stem + f".partial-{os.getpid()}.infernix")
    hf_dir = path.parent / f"{path.stem}.partial-{os.getpid()}-hf"
    try:
        make_tiny(partial, family="dense", vocab="real", seed=DEMO_SEED, hf_dir=hf_dir,
                  log=None, on_phase=phase)
        partial.replace(path)                # atomic: concurrent first runs stay consistent
        phase(f"demo model built ({time.perf_counter() - started:.1f} s)")
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
        partial.unlink(missing_ok=True)
    return path


def model_and_device(settings: Any, logger) -> tuple[Path, str]:
    """The model file to load and the device ("cpu" or "cuda") to run it on; option mistakes
    are ConfigErrors."""
    model = settings.model
    if settings.demo:
        if model is not None:
            raise ConfigError("--demo runs a generated tiny model; give no model path")
        if settings.device not in ("auto", "cpu"):
            # The GPU kernels are compiled for real model shapes and the 512-token test
            # model; the demo's (real vocabulary, hidden size 256) is not among them.
            logger.warning("--demo runs on the CPU, not --device %s: no GPU kernels are "
                           "built for the demo model's shapes; give a converted model "
                           "(python -m tools.convert) to run on the GPU", settings.device)
        logger.info("demo: tiny random-weight model with the real Qwen vocabulary, CPU")
        return demo_model_path(logger), "cpu"
    if model is None:
        raise ConfigError("no model given: pass MODEL (a .infernix file), set `model` "
                          "in --config, or use --demo")
    model_path = Path(model)
    if not model_path.exists():
        raise ConfigError(f"model {model!r} does not exist")
    if model_path.is_dir():
        raise ConfigError(_directory_given(model_path))
    return model_path, choose_device(settings.device)


def _directory_given(path: Path) -> str:
    """What to say when the model path is a directory (a model is one `.infernix` file)."""
    if (path / "config.json").is_file():
        return (f"model {str(path)!r} is a Hugging Face checkpoint directory; convert it "
                f"first: python -m tools.convert {path} OUT.infernix (then run with "
                "OUT.infernix)")
    return f"model {str(path)!r} is a directory, not a .infernix file"
