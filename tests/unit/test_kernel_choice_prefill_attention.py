"""The runner's prefill attention choice: the WGMMA kernel's wg2 form where it was built for the
model's shape, launched with the same buffers as the mma.sync kernel it replaces."""

from __future__ import annotations

import pytest

from runtime.model.shapes import shape_config


@pytest.mark.parametrize("shape,key", [("qwen3.6-27b", "fwd_q24_kv4_d256_wg2"),
                                       ("qwen3.6-35b-a3b", "fwd_q16_kv2_d256_wg2")])
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
    mma_sync = library.manifest.kernels[("attention_prefill", key.removesuffix("_wg2"))]
    assert [p.name for p in wgmma.params] == [p.name for p in mma_sync.params]
