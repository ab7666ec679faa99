"""`CudaRunner` on the tiny Qwen3-Next model (`tools/make_tiny.py --next`: fused `in_proj_qkvz` /
`in_proj_ba` on disk, regrouped to the split form by the conversion; 8 experts, top 2,
`norm_topk_prob`, a shared expert; plain 1-D RoPE) against `NumpyRunner`, by the rules the dense
and MoE models are held to (test_cuda_runner.py's checks, run with this module's `tiny_path`):
logits within 2x of a torch BF16 forward's error, top-1 agreement, greedy continuations whose
misses are near-ties, batched equal to alone and graph replay equal to eager launches, prefill in
pieces, decode equal to prefill; plus a decode batch of 8 equal to each row alone.
"""

from __future__ import annotations

import pytest

from .test_cuda_runner import (runners, test_batched_equals_alone_and_graph_equals_eager,  # noqa: F401
                               test_decode_matches_prefill, test_greedy_continuation_matches_reference,
                               test_prefill_in_pieces, test_prefill_logits_match_reference)
from .test_cuda_runner_moe import test_a_batch_of_eight_equals_each_row_alone  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_path(tiny_next_path):
    return tiny_next_path


def test_the_model_is_next_and_runs_the_moe_kernels_with_renormalised_weights(runners):  # noqa: F811
    cuda, _ = runners
    c = cuda.config
    assert c.family == "next" and c.norm_topk_prob and c.mrope_section is None
    route = cuda.library.manifest.kernels[("moe", cuda.kernels.moe_route)].config
    assert route["renorm"] is True and route["E"] == 8 and route["K"] == 2
    assert cuda.kernels.moe_prefill is not None
