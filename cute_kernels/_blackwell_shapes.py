"""The shapes of the Blackwell block-scaled prefill GEMMs (`gemm_bs_sm100`, `gemm_bs_sm120`), in
one place so the two families build the same list."""

# (name, N, K): the Qwen3.6-27B prefill projections (gdn_in without its 96-row BF16 tail, which
# would stay a BF16 GEMM) and a small shape for the GPU tests.
SHAPES = [
    ("gdn_in", 16384, 5120),
    ("o_proj", 5120, 6144),
    ("attn_qkv", 14336, 5120),
    ("gate_up", 34816, 5120),
    ("down", 5120, 17408),
    ("test", 256, 512),
]
