"""The chunked GDN prefill kernel inside `CudaRunner`, against the recurrent `split` path.

A 4-layer model of the Qwen3.6-27B shapes (three GDN layers, one attention layer; synthetic
weights, the tiny models have no chunked variant) prefills the same prompt twice: once with the
kernels the runner picks (chunked), once pointed at the split kernel. Both are BF16 computations
of the same model with different summation orders, so the last-position logits and every GDN
layer's recurrent state must agree within BF16 noise (3 % relative L2).
The prompt (700 tokens, pieces of 256) exercises the chunk tail and a carried state across pieces.
"""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import rel_err

pytestmark = pytest.mark.gpu

LAYERS = 4


@pytest.fixture(scope="module")
def runner(device, library):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner

    shape = {**QWEN36_27B, "num_hidden_layers": LAYERS, "layer_types": QWEN36_27B["layer_types"][:LAYERS]}
    r = CudaRunner.synthetic(ModelConfig.from_dict(shape), 7, num_pages=16, num_slots=2, max_batch=1,
                             max_context=1024, prefill_chunk=256, device=device, library=library)
    if not r.kernels.gdn_chunked or not r.kernels.gdn_split:
        pytest.skip("the chunked or split GDN kernel was not built for the 27B shape")
    yield r
    r.close()


def _prefill(runner, ids):
    from runtime.model.runner import PrefillChunk

    runner.reset_slot(0)
    logits = runner.prefill(PrefillChunk(slot=0, token_ids=ids, start_pos=0, page_table=list(range(11))))
    states = [runner.read_state(n, 0)[0] for n in range(len(runner.config.linear_layers))]
    return logits[-1], states


def test_chunked_prefill_matches_split(runner, record_property):
    ids = np.random.default_rng(3).integers(0, runner.config.vocab_size, 700).tolist()
    k = runner.kernels
    chunked_logits, chunked_states = _prefill(runner, ids)
    chunked_key = k.gdn_chunked
    k.gdn_chunked = None
    runner.steps.plans.clear()
    try:
        split_logits, split_states = _prefill(runner, ids)
    finally:
        k.gdn_chunked = chunked_key
        runner.steps.plans.clear()
    assert np.isfinite(chunked_logits).all()
    e_logits = rel_err(chunked_logits, split_logits)
    e_states = [rel_err(a, b) for a, b in zip(chunked_states, split_states)]
    record_property("logits_rel_err", e_logits)
    record_property("state_rel_errs", e_states)
    assert e_logits < 3e-2, e_logits
    assert max(e_states) < 3e-2, e_states
