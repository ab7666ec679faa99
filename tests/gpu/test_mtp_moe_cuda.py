"""The MTP head with a MoE MLP (the 35B-A3B's kind) on `CudaRunner`: the tiny MoE model's head
(8 experts, top 2, a shared expert) against `NumpyRunner`'s, and `--spec mtp` equal to plain
decoding.

The checks are test_mtp_cuda.py's, by its rules (its docstring: the head's logits within
`REL_TOL` of the largest magnitude or 3x the main model's own error at the same position, greedy
drafts compared where the reference's top-2 margin is clear), collected here with this module's
`tiny_path`: the MoE artifact. The head's MoE MLP adds the router, routing and expert roundings of a
main MoE layer, whose error the main model's logits (four such layers) already carry. Prompts of
40..103 positions make the catch-up take the grouped prefill GEMMs, the chained drafts the decode
form. Speculation runs test_mtp_cuda.py's three configurations at the tiny MoE model only.
"""

from __future__ import annotations

import pytest

from .engine_runs import small_runner
from .test_cuda_runner_moe import tiny_path  # noqa: F401 - the module fixture: the tiny MoE model
from .test_mtp_cuda import (LANES, SLOTS, runners,  # noqa: F401 - the fixtures and tests run here
                            test_catch_up_logits_and_chained_drafts_match_the_reference,
                            test_graphs_and_eager_launches_draft_the_same, test_mtp_speculation_equals_plain_decoding,
                            test_the_device_chain_drafts_what_the_host_chain_drafts)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def spec_runner(tiny_path, device, library):  # noqa: F811 - the fixture imported above
    r = small_runner("tiny", tiny_path, device, library, num_pages=64, num_slots=SLOTS, max_batch=LANES,
                     max_context=1024, prefill_chunk=128, mtp=True)
    yield r
    r.close()


def test_the_head_is_moe_and_its_catch_up_takes_the_grouped_gemms(runners):  # noqa: F811 - the fixture imported above
    cuda, _ = runners
    assert cuda.config.mtp_mlp_type == "moe" and "experts_gate_up" in cuda.layout.mtp_layers[0]
    assert cuda.kernels.moe_prefill is not None, "moe_grouped was not built for the tiny MoE shape"
