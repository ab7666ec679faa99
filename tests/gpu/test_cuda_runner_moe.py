"""`CudaRunner` on the tiny MoE model (`tools/make_tiny.py --moe`: 8 experts, top 2, a shared
expert) against `NumpyRunner`, by the rules the dense model is held to.

The checks are those of test_cuda_runner.py, run here with this module's `tiny_path` (pytest
resolves a test's fixtures in the module that collects it): logits within 2x of a torch BF16
forward's error (tests/gpu/torch_forward.py computes the MoE MLP as Hugging Face rounds it), top-1
agreement, greedy continuations whose misses are near-ties, several sequences batched equal to
each alone and graph replay equal to eager launches (bit for bit), prefill in pieces, decode equal
to prefill.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from .test_cuda_runner import (runners, test_batched_equals_alone_and_graph_equals_eager,  # noqa: F401
                               test_decode_matches_prefill, test_greedy_continuation_matches_reference,
                               test_prefill_in_pieces, test_prefill_logits_match_reference)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = Path(os.environ.get("INFERNIX_TINY_MOE", REPO / "build" / "tiny-moe.infernix"))
    if not path.exists():
        from tools.make_tiny import make_tiny

        path = tmp_path_factory.mktemp("tiny") / "tiny-moe.infernix"
        make_tiny(path, family="moe", seed=0, vocab="small")
    return path


def test_the_model_is_moe_and_runs_the_moe_kernels(runners):
    """Both MoE forms are loaded: decode steps (up to MOE_DECODE_ROWS rows) run the decode form,
    prompts longer than that the split form, so `test_decode_matches_prefill` also holds the two
    forms to the same numbers."""
    from runtime.model.gpu.kernels import MOE_DECODE_FORM

    cuda, _ = runners
    assert cuda.config.family == "moe" and cuda.kernels.moe_down is not None
    assert MOE_DECODE_FORM is None or ((cuda.kernels.moe_route_up or cuda.kernels.moe_up_wide)
                                       and cuda.kernels.moe_down_wide)


def test_a_batch_of_eight_equals_each_row_alone(runners):
    """A decode step of 8 sequences (the largest bucket, every expert slot of the grid in use)
    equals each sequence decoded alone, bit for bit: the MoE kernels reduce every row on its own."""
    cuda, _ = runners
    vocab = cuda.vocab_size
    prompts = [np.random.default_rng(50 + i).integers(0, vocab, 9 + 3 * i).tolist() for i in range(8)]
    slots = list(range(8))

    def prefill(slot, ids):
        cuda.reset_slot(slot)
        cuda.prefill(PrefillChunk(slot=slot, token_ids=ids, start_pos=0, page_table=[slot * 8]))

    def item(slot, ids):
        return DecodeItem(slot=slot, token_id=11 + slot, pos=len(ids), page_table=[slot * 8])

    for slot, ids in zip(slots, prompts):
        prefill(slot, ids)
    batched = cuda.decode([item(slot, ids) for slot, ids in zip(slots, prompts)])
    alone = []
    for slot, ids in zip(slots, prompts):
        prefill(slot, ids)
        alone.append(cuda.decode([item(slot, ids)])[0])
    np.testing.assert_array_equal(batched, np.stack(alone))


def test_prefill_through_the_grouped_kernels_matches_the_per_row_kernels(runners, record_property):
    """A prompt prefilled through `moe_grouped` (the runner's prefill path) against the same prompt
    through the decode kernels (`moe_prefill` cleared): the same routing and roundings, only the
    K order of the expert dot products differs, so the logits differ far less than either differs
    from the NumPy reference."""
    cuda, ref = runners
    assert cuda.kernels.moe_prefill is not None, "moe_grouped was not built for the tiny MoE shape"
    ids = np.random.default_rng(21).integers(0, cuda.vocab_size, 100).tolist()
    pages = list(range(72, 74))

    def prefill(runner):
        runner.reset_slot(11)
        return runner.prefill(PrefillChunk(slot=11, token_ids=ids, start_pos=0, page_table=pages, all_logits=True))

    grouped = prefill(cuda)
    saved = cuda.kernels.moe_prefill
    cuda.kernels.moe_prefill = None
    cuda.steps.plans.clear()
    try:
        per_row = prefill(cuda)
    finally:
        cuda.kernels.moe_prefill = saved
        cuda.steps.plans.clear()
    want = prefill(ref)

    def rel(a, b):
        return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))

    e_paths, e_ref = rel(grouped, per_row), rel(per_row, want)
    record_property("grouped_vs_per_row", e_paths)
    record_property("per_row_vs_numpy", e_ref)
    print(f"grouped vs per-row {e_paths:.2e}, per-row vs numpy {e_ref:.2e}")
    assert e_paths <= max(0.5 * e_ref, 1e-3), (e_paths, e_ref)
