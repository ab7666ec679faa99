"""FP8 / INT8 KV (`--kv-dtype`) in `CudaRunner` against BF16 KV, on a 4-layer model of the
Qwen3.6-27B shapes (three GDN layers, one attention layer; synthetic weights).

The same prompt (700 tokens, prefill pieces of 256: the WGMMA prefill kernel over the format)
then 6 decode steps (the split kernel over the format) run once per KV format. Quantised KV is
a different computation, so the logits are compared with the BF16-KV run's by relative L2 error,
printed (`-s`) and recorded (`--junitxml`). The bounds follow from the formats' rounding: an e4m3
code is within 2^-4 of its value (relative), an int8 code within amax / 254 (about 1 % of a
Gaussian row's RMS); the one attention layer's output cannot move further than its K/V inputs,
and it is one of four residual contributions, so the logits' relative error stays below the
per-element bound (fp8 6.25 %, int8 ~1 %): asserted at 1.5x and 3x that. Not yet run on a GPU:
tighten the bounds to about 2x the printed errors once measured.
"""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import rel_err

pytestmark = pytest.mark.gpu

LAYERS = 4
PROMPT, STEPS = 700, 6
BOUND = {"fp8": 0.094, "int8": 0.03}  # relative L2 of the logits vs BF16 KV (see the docstring)


@pytest.fixture(scope="module")
def logits(device, library):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.runner import DecodeItem, PrefillChunk

    shape = {**QWEN36_27B, "num_hidden_layers": LAYERS, "layer_types": QWEN36_27B["layer_types"][:LAYERS]}
    config = ModelConfig.from_dict(shape)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, config.vocab_size, PROMPT).tolist()
    steps = rng.integers(0, config.vocab_size, STEPS).tolist()
    table = list(range(-(-(PROMPT + STEPS) // 64)))
    out = {}
    for fmt in ("bf16", "fp8", "int8"):
        r = CudaRunner.synthetic(config, 7, num_pages=16, num_slots=1, max_batch=1, max_context=1024,
                                 prefill_chunk=256, device=device, library=library, kv_dtype=fmt)
        try:
            assert r.storage.page_bytes == {"bf16": 131072, "fp8": 66560, "int8": 66560}[fmt]
            rows = [r.prefill(PrefillChunk(slot=0, token_ids=ids, start_pos=0, page_table=table))[-1]]
            for i, t in enumerate(steps):
                rows.append(r.decode([DecodeItem(slot=0, token_id=t, pos=PROMPT + i, page_table=table)])[0])
            out[fmt] = np.stack(rows)
        finally:
            r.close()
    return out


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantised_kv_logits_near_bf16_kv(logits, fmt, record_property):
    got, want = logits[fmt], logits["bf16"]
    assert np.isfinite(got).all()
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    record_property("logit_rel_errs", errs)
    print(f"\n{fmt} KV vs bf16 KV, logits relative L2: prefill {errs[0]:.3e}, decode "
          + " ".join(f"{e:.3e}" for e in errs[1:]))
    assert max(errs) < BOUND[fmt], errs
    unrelated = rel_err(want[1], want[2])  # two different decode steps: what "far" looks like
    assert max(errs) < unrelated / 10, (errs, unrelated)
