"""Shared pytest set-up: the `gpu` marker skips (with the reason) where no usable GPU exists."""

from __future__ import annotations

import ctypes.util
import os

import pytest


def _gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when a CUDA driver and a device are present."""
    if os.environ.get("INFERNIX_SKIP_GPU_TESTS"):
        return "INFERNIX_SKIP_GPU_TESTS is set"
    if ctypes.util.find_library("cuda") is None:
        return "no CUDA driver (libcuda) on this machine"
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return f"cuda-bindings not importable: {exc}"
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name}"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device visible"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


# ---------------------------------------------------------------------------------------------
# Tiny models (tools/make_tiny.py), generated once per test session. Each fixture returns the
# path of a `.infernix` artifact; its Hugging Face directory sits next to it as `<stem>-hf`.

def _tiny(tmp_path_factory, family: str, vocab: str = "small"):
    from tools.make_tiny import make_tiny
    directory = tmp_path_factory.mktemp(f"tiny-{family}-{vocab}")
    return make_tiny(directory / f"tiny-{family}.infernix", family=family, vocab=vocab, seed=0)


@pytest.fixture(scope="session")
def tiny_dense_path(tmp_path_factory):
    """Qwen3.5 dense tiny model, 512-token vocabulary."""
    return _tiny(tmp_path_factory, "dense")


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory):
    """Qwen3.5-MoE tiny model (8 experts, top-2, shared expert), 512-token vocabulary."""
    return _tiny(tmp_path_factory, "moe")


@pytest.fixture(scope="session")
def tiny_next_path(tmp_path_factory):
    """Qwen3-Next tiny model (MoE, fused GDN projections on disk), 512-token vocabulary."""
    return _tiny(tmp_path_factory, "next")


@pytest.fixture(scope="session")
def tiny_real_vocab_path(tmp_path_factory):
    """Qwen3.5 dense tiny model with the real Qwen3.5 tokenizer (248,320 rows, tied
    embeddings; ~130 MB, a few seconds to build)."""
    return _tiny(tmp_path_factory, "dense", "real")


@pytest.fixture(scope="session")
def tiny_fp8_path(tmp_path_factory):
    """Qwen3.5 dense tiny model converted with the FP8 recipe (e4m3 codes, 128x128 block
    scales), 512-token vocabulary."""
    from tools import convert
    from tools.make_tiny import make_hf_dir

    root = tmp_path_factory.mktemp("tiny-fp8")
    hf = make_hf_dir(root / "hf", family="dense", seed=0, vocab="small")
    return convert.convert(hf, root / "tiny-fp8.infernix", convert.Recipe("fp8"), name="tiny-fp8")


@pytest.fixture(scope="session")
def tiny_nvfp4_path(tmp_path_factory):
    """Qwen3.5 dense tiny model converted with the NVFP4 recipe (e2m1 codes, e4m3 scale per 16
    columns, fp32 global per tensor; in_proj_a / in_proj_b and lm_head bf16), 512-token vocabulary."""
    from tools import convert
    from tools.make_tiny import make_hf_dir

    root = tmp_path_factory.mktemp("tiny-nvfp4")
    hf = make_hf_dir(root / "hf", family="dense", seed=0, vocab="small")
    return convert.convert(hf, root / "tiny-nvfp4.infernix", convert.Recipe("nvfp4"), name="tiny-nvfp4")


@pytest.fixture(scope="session")
def tiny_moe_fp8_path(tmp_path_factory):
    """Qwen3.5-MoE tiny model converted with the FP8 recipe: every expert (the shared one too) and
    projection e4m3 with 128x128 block scales (an expert half of I = 64 rows is one scale row),
    the router and shared-expert gate bf16."""
    from tools import convert
    from tools.make_tiny import make_hf_dir

    root = tmp_path_factory.mktemp("tiny-moe-fp8")
    hf = make_hf_dir(root / "hf", family="moe", seed=0, vocab="small")
    return convert.convert(hf, root / "tiny-moe-fp8.infernix", convert.Recipe("fp8"), name="tiny-moe-fp8")


@pytest.fixture(scope="session")
def tiny_moe_nvfp4_path(tmp_path_factory):
    """Qwen3.5-MoE tiny model converted with the NVFP4 recipe: every expert (the shared one too;
    a fused gate|up expert keeps a global per half) and projection NVFP4, the router, shared-expert
    gate, in_proj_a / in_proj_b and lm_head bf16."""
    from tools import convert
    from tools.make_tiny import make_hf_dir

    root = tmp_path_factory.mktemp("tiny-moe-nvfp4")
    hf = make_hf_dir(root / "hf", family="moe", seed=0, vocab="small")
    return convert.convert(hf, root / "tiny-moe-nvfp4.infernix", convert.Recipe("nvfp4"), name="tiny-moe-nvfp4")


@pytest.fixture(scope="session")
def tiny_next_fp8_path(tmp_path_factory):
    """Qwen3-Next tiny model converted with the FP8 recipe (as `tiny_moe_fp8_path`)."""
    from tools import convert
    from tools.make_tiny import make_hf_dir

    root = tmp_path_factory.mktemp("tiny-next-fp8")
    hf = make_hf_dir(root / "hf", family="next", seed=0, vocab="small")
    return convert.convert(hf, root / "tiny-next-fp8.infernix", convert.Recipe("fp8"), name="tiny-next-fp8")
