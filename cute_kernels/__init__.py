"""CuTe DSL kernel families, one file per family, each with its compile-time parameters, the
kernel, `variants()` and a NumPy `reference()`. Imported only at build time by
`build_kernels.py` (and by tests for the references); the runtime never imports it."""

# Family modules `build_kernels.py` compiles, in build order (names of modules in this package).
FAMILIES = ("rmsnorm", "embedding", "rope", "silu_mul", "gemv", "gemv_fp8", "gemv_nvfp4", "gemm_sm90", "quantize_act", "gemm_fp8_sm90", "gemm_bs_sm100", "gemm_bs_sm120", "dequant_nvfp4", "conv1d", "gdn", "gdn_chunked", "attention", "attention_decode_mma", "attention_prefill", "attention_wgmma", "sampling", "moe", "moe_grouped", "dequant_weights",
            "vision_bias", "vision_norm", "vision_rope", "vision_attention", "vision_pos")
