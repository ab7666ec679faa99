"""bench/moe_forms.py on the null device: the forms it times cover every compiled decode variant of
the 35B-A3B shape (and the runner's choice), and every launch it binds matches its kernel's
buffers (a wrong name would only show on the H200 otherwise)."""

from __future__ import annotations

from bench.moe_forms import forms, launch_args
from cute_kernels import moe

from null_cuda import built_or_skip


def test_forms_cover_every_decode_variant_and_the_runner_choice():
    from runtime.model.gpu.kernels import MOE_DECODE_FORM

    named = forms(2048, 256)
    assert named[0] == ("split", ["logits_e256_h2048", "route_h2048_e256_k8_i512", "up_h2048_e256_k8_i512",
                                  "down_h2048_e256_k8_i512"])
    a3b = [v for v in moe.variants() if (v.config["H"], v.config["E"]) == (2048, 256)]
    kinds = {kind: {v.key for v in a3b if v.config["kind"] == kind} for kind in ("route_up", "up_wide", "down_wide")}
    assert len(kinds["route_up"]) == len(kinds["up_wide"]) == len(moe.ROUTE_UP_FEATURES)
    assert len(kinds["down_wide"]) == len(moe.DOWN_WIDE_ROWS)
    fused = {(keys[1], keys[2]) for name, keys in named[1:] if name.startswith("route_up")}
    staged = {(keys[2], keys[3]) for name, keys in named[1:] if name.startswith("up_wide")}
    assert fused == {(g, d) for g in kinds["route_up"] for d in kinds["down_wide"]}
    assert staged == {(g, d) for g in kinds["up_wide"] for d in kinds["down_wide"]}
    assert len(named) == 1 + len(fused) + len(staged)
    gate_up, features, form = MOE_DECODE_FORM
    assert f"{gate_up}_f{features}_{form}" in dict(named)
    assert dict(named)["route_up_f8_r1"] == ["logits_wide_e256_h2048", "route_up_h2048_e256_k8_i512_f8",
                                             "down_wide_h2048_e256_k8_i512_r1"]
    assert dict(named)["up_wide_f16_r2"] == ["logits_wide_e256_h2048", "route_h2048_e256_k8_i512",
                                             "up_wide_h2048_e256_k8_i512_f16", "down_wide_h2048_e256_k8_i512_r2"]


def test_every_launch_passes_exactly_its_kernels_buffers():
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice

    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    built_or_skip(lambda: [lib.kernel("moe", key) for _, keys in forms(2048, 256) for key in keys])  # none stale
    bufs = {name: 0x1000 * (i + 1) for i, name in enumerate(("x", "logits", "ids", "wts", "act", "out"))}
    weights = {name: 0x100000 * (i + 1) for i, name in enumerate(("router", "w_sg", "gate_up", "down"))}
    for _, keys in forms(2048, 256):
        for key in keys:
            args = launch_args(key, bufs, weights)
            assert set(args) == set(lib.manifest.kernels[("moe", key)].tensors), key
            lib.kernel("moe", key).bind(args, {"M": 8})  # raises on a size rule or alignment
    # The expert stacks go where each kind reads them.
    assert launch_args("route_up_h2048_e256_k8_i512_f8", bufs, weights)["w"] == weights["gate_up"]
    assert launch_args("down_wide_h2048_e256_k8_i512_r1", bufs, weights)["w"] == weights["down"]
    assert launch_args("route_h2048_e256_k8_i512", bufs, weights)["w_sg"] == weights["w_sg"]


def test_the_quantised_expert_launches_pass_their_stacks_and_scales():
    """up_fp8 / down_fp8 / up_nvfp4 / down_nvfp4 bind exactly their kernels' buffers, each reading
    its format's stack, its scales and (NVFP4) its globals."""
    from bench.moe_forms import QUANTISED
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice

    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    bufs = {name: 0x1000 * (i + 1) for i, name in enumerate(("x", "logits", "ids", "wts", "act", "out"))}
    names = [f"{stack}_{fmt}{part}" for fmt in QUANTISED for stack in ("gate_up", "down")
             for part in ("", "_scale", "_gscale")]
    weights = {name: 0x100000 * (i + 1) for i, name in enumerate(("router", "w_sg", "gate_up", "down", *names))}
    for fmt, kinds in QUANTISED.items():
        for kind, stack in zip(kinds, ("gate_up", "down")):
            key = f"{kind}_h2048_e256_k8_i512"
            args = launch_args(key, bufs, weights)
            assert set(args) == set(lib.manifest.kernels[("moe", key)].tensors), key
            assert (args["w"], args["scale"]) == (weights[f"{stack}_{fmt}"], weights[f"{stack}_{fmt}_scale"])
            if fmt == "nvfp4":
                assert args["gscale"] == weights[f"{stack}_nvfp4_gscale"]
            built_or_skip(lambda: lib.kernel("moe", key)).bind(args, {"M": 8})
