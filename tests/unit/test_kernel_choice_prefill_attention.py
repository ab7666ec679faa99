"""The runner's prefill attention choice: the WGMMA kernel in the runner's form
(`PREFILL_ATTENTION_FORM`, wg2p) where built for the model's shape, launched with the same buffers
as the mma.sync kernel it replaces."""

from __future__ import annotations

import pytest

from runtime.model.shapes import shape_config


@pytest.mark.parametrize("shape,key", [("qwen3.6-27b", "fwd_q24_kv4_d256_wg2p"),
                                       ("qwen3.6-35b-a3b", "fwd_q16_kv2_d256_wg2p")])
def test_prefill_attention_is_the_wgmma_kernel_where_built(shape, key):
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.manifest import ManifestError
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice

    try:
        library = KernelLibrary.open(NullDevice(total_memory=200 << 30), required=[])
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    if ("attention_wgmma", key) not in library.manifest.kernels:
        pytest.skip(f"attention_wgmma/{key} was not built")
    kernels = KernelChoice(library, ModelConfig.from_dict(shape_config(shape)))
    assert kernels.prefill_attn == ("attention_wgmma", key)
    assert ("attention_wgmma", key) in kernels.required()
    wgmma = library.manifest.kernels[("attention_wgmma", key)]
    mma_sync = library.manifest.kernels[("attention_prefill", key.removesuffix("_wg2p"))]
    assert [p.name for p in wgmma.params] == [p.name for p in mma_sync.params]


@pytest.mark.parametrize("shape,name", [("qwen3.6-27b", "q24_kv4_d256"), ("qwen3.6-35b-a3b", "q16_kv2_d256")])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_prefill_attention_form_constant_picks_the_overlapped_form(monkeypatch, shape, name, fmt):
    """PREFILL_ATTENTION_FORM = "wg2p" takes the overlapped kernel for the fused prefill over bf16
    KV (over key splits wg2); quantised KV keeps wg2 (wg2p reads bf16 pages only)."""
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.manifest import ManifestError
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu import kernels as gpu_kernels

    try:
        library = KernelLibrary.open(NullDevice(total_memory=200 << 30), required=[])
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    for key in (f"fwd_{name}_wg2p", f"fwd_{name}_wg2_kvsplit", f"fwd_{name}_wg2_fp8"):
        if ("attention_wgmma", key) not in library.manifest.kernels:
            pytest.skip(f"attention_wgmma/{key} was not built")
    monkeypatch.setattr(gpu_kernels, "PREFILL_ATTENTION_FORM", "wg2p")
    k = gpu_kernels.KernelChoice(library, ModelConfig.from_dict(shape_config(shape)), kv_dtype=fmt)
    if fmt == "bf16":
        assert k.prefill_attn == ("attention_wgmma", f"fwd_{name}_wg2p")
        # Over key splits wg2, the only form built there (attention_wgmma.KV_SPLIT_FORMS).
        assert k.prefill_attn_split == f"fwd_{name}_wg2_kvsplit"
        assert ("attention_wgmma", f"fwd_{name}_wg2_kvsplit") in k.required()
    else:
        assert k.prefill_attn == ("attention_wgmma", f"fwd_{name}_wg2_fp8")
        assert k.prefill_attn_split is None  # no quantised form over key splits, as with wg2
