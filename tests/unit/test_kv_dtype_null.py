"""`--kv-dtype fp8|int8` from the option to the CUDA runner's storage and kernel choice (the null
device records launches; values are checked on a GPU in tests/gpu/test_attention_kv_quant.py
and test_kv_dtype_runner.py), and the CPU backend's refusal. Needs the built kernels."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from runtime.config import ConfigError
from runtime.model.runner import DecodeItem, PrefillChunk
from runtime.model.shapes import shape_config
from runtime.session.backend import make_runner

from null_cuda import built_or_skip


def _library():
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.manifest import ManifestError
    from runtime.cuda.null import NullDevice

    try:
        return KernelLibrary.open(NullDevice(total_memory=200 << 30), required=[])
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_tiny_runner_pages_and_launches(tmp_path, fmt):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner
    from tools.make_tiny import make_tiny

    path = tmp_path / "tiny.infernix"
    make_tiny(path, family="dense", seed=0, vocab="small")
    device = NullDevice(total_memory=2 << 30)
    r = built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=16, num_slots=2, device=device,
                                                       prefill_chunk=64, kv_dtype=fmt))
    try:
        c = r.config
        # One layer's K page: 64 tokens x Hkv x (D code bytes + a 4-byte scale).
        assert r.storage.page_bytes == 64 * c.num_key_value_heads * (c.head_dim + 4)
        assert r.page_nbytes == 2 * (len(c.attention_layers)) * r.storage.page_bytes
        assert (r.kernels.prep, r.kernels.split) == (f"prep_q4_kv2_d64_{fmt}", f"split_q4_kv2_d64_{fmt}")
        assert r.kernels.prefill_attn is None  # the tiny shape's prefill kernel is bf16 only: split-KV
        first = len(device.launches)
        r.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 100)), start_pos=0, page_table=[0, 1]))
        r.decode([DecodeItem(slot=0, token_id=5, pos=99, page_table=[0, 1])])
        names = [launch.function for launch in device.launches[first:]]
        assert any(f"prep_q4_kv2_d64_{fmt}" in n for n in names)
        assert any(f"split_q4_kv2_d64_{fmt}" in n for n in names)
        # No bf16 prep or split (their entries are "..._prep_q4_kv2_d64_kernel...").
        assert not any("prep_q4_kv2_d64_kernel" in n or "split_q4_kv2_d64_kernel" in n for n in names)
        assert not any("attention_prefill" in n for n in names)
    finally:
        r.close()


@pytest.mark.parametrize("shape,name", [("qwen3.6-27b", "q24_kv4_d256"), ("qwen3.6-35b-a3b", "q16_kv2_d256")])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
def test_real_shapes_choose_the_format_kernels(shape, name, fmt):
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice

    library = _library()
    suffix = "" if fmt == "bf16" else f"_{fmt}"
    if ("attention", f"split_{name}{suffix}") not in library.manifest.kernels:
        pytest.skip(f"attention/split_{name}{suffix} was not built")
    k = KernelChoice(library, ModelConfig.from_dict(shape_config(shape)), kv_dtype=fmt)
    assert (k.prep, k.split, k.combine) == (f"prep_{name}{suffix}", f"split_{name}{suffix}", f"combine_{name}")
    # bf16 pages take the runner's form (wg2p), quantised ones the wg2 kernel over their format.
    assert k.prefill_attn == ("attention_wgmma", f"fwd_{name}_wg2p" if fmt == "bf16" else f"fwd_{name}_wg2{suffix}")
    assert library.manifest.kernels[("attention", k.split)].config["kv"] == fmt


def test_cpu_backend_refuses_quantised_kv():
    settings = SimpleNamespace(synthetic_weights=None, synthetic_shape=None, kv_dtype="fp8", device="cpu",
                               mtp_draft_vocab=None)
    with pytest.raises(ConfigError, match=r"--kv-dtype fp8: the CPU backend keeps KV in float32 .* fp8 and int8 "
                                          r"KV run on the CUDA backend \(--device cuda\)"):
        make_runner("cpu", None, 4, 1, 1, 64, settings, logging.getLogger("test"))


def test_option_accepts_the_formats():
    from runtime.options import OPTIONS

    option = next(o for o in OPTIONS if o.name == "kv-dtype")
    assert option.choices == ("bf16", "fp8", "int8") and option.default == "bf16"
